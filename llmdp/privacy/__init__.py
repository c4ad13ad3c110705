"""Privacy core: events, plan, accountant, ledger, sampling and noise.

Importable without Ray. It imports torch: the ChaCha20 keystream behind sampling and
noise (`chacha`) is computed with torch.
"""

from llmdp.config.choices import SAMPLERS
from llmdp.privacy.accountant import (
    ACCOUNTANTS,
    delta_for_epsilon,
    epsilon,
    epsilon_estimate,
    epsilon_for,
)
from llmdp.privacy.chacha import chacha20_keystream
from llmdp.privacy.events import (
    compose,
    dpsgd_step_event,
    event_from_json,
    event_to_json,
    is_truncated,
)
from llmdp.privacy.keys import secure_key, seeded_key
from llmdp.privacy.ledger import LEDGER_FILENAME, Ledger, LedgerError
from llmdp.privacy.noise import add_gaussian_, add_noise_, gaussian_like
from llmdp.privacy.plan import (
    DPPlan,
    PlanError,
    calibrate_noise,
    default_delta,
    make_plan,
    steps_for_epochs,
)
from llmdp.privacy.reference_sampler import ReferencePoissonSampler
from llmdp.privacy.sampling import (
    PoissonSampler,
    TruncatedPoissonSampler,
    make_sampler,
    uniform_stream,
)
from llmdp.privacy.truncation import truncation_cost, truncation_probability

__all__ = [
    "ACCOUNTANTS",
    "DPPlan",
    "LEDGER_FILENAME",
    "Ledger",
    "LedgerError",
    "PlanError",
    "PoissonSampler",
    "ReferencePoissonSampler",
    "SAMPLERS",
    "TruncatedPoissonSampler",
    "add_gaussian_",
    "add_noise_",
    "calibrate_noise",
    "chacha20_keystream",
    "compose",
    "default_delta",
    "delta_for_epsilon",
    "dpsgd_step_event",
    "epsilon",
    "epsilon_estimate",
    "epsilon_for",
    "event_from_json",
    "event_to_json",
    "gaussian_like",
    "is_truncated",
    "make_plan",
    "make_sampler",
    "secure_key",
    "seeded_key",
    "steps_for_epochs",
    "truncation_cost",
    "truncation_probability",
    "uniform_stream",
]

