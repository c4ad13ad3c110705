"""DP evaluation: held-out loss and token accuracy released with the Gaussian mechanism.

Several aggregates released together from one query (the DPQuery pattern): each held-out
unit contributes a vector with one coordinate per aggregate, each clipped to its declared
range and scaled to [0, 1]:

    loss      min(max(loss_u, 0), L) / L      (L: ``eval.loss_bound``; NaN counts as L)
    accuracy  correct target tokens / target tokens of the unit, in [0, 1]
    count     1                               (``eval.count: noised`` only)

Adding or removing one unit changes the vector sum by at most sqrt(k) in L2 (k aggregates;
also when ``data.eval.max_units`` makes the unit displace another: every coordinate
changes by at most 1). One Gaussian noise of std ``z * sqrt(k)`` is added to every
coordinate of the sum: ``GaussianDpEvent(z)`` (z: the noise multiplier relative to the L2
sensitivity), recorded write-ahead in the run's ledger and composed into the run's and the
dataset's ε like every step. The means are post-processing: loss = L (S_loss + e_1) / n,
accuracy = (S_acc + e_2) / n, with n the noised count (S_count + e_3, at least 1) or, with
``eval.count: public``, the number of held-out units published as is (like N).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from llmdp.privacy import accounting as _acc
from llmdp.privacy.noise import keyed_normal

if TYPE_CHECKING:  # imported where used: a training worker loads this module, never those
    import dp_accounting

__all__ = ["DpEvalPlan", "plan_dp_eval", "noisy_sums", "release", "normalized_sums"]

AGGREGATES = ("loss", "accuracy", "count")
# A DP evaluation whose expected noise std exceeds this fraction of its metric's range
# (loss: [0, L]; accuracy: [0, 1]) is refused at plan time unless eval.allow_noisy: a
# release whose std is a twentieth of everything the metric can say tells little, and a
# selection or a card built on it is built on noise.
NOISY_EVAL_FRACTION = 0.05
_MIN_Z = 0.2  # the smallest noise multiplier eval.epsilon is calibrated to (PLD grid size)
_Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


@dataclass(frozen=True)
class DpEvalPlan:
    """The DP evaluations of one run: ``releases`` Gaussian releases of noise multiplier
    ``noise_multiplier`` (relative to the L2 sensitivity of the scaled aggregates)."""

    noise_multiplier: float
    releases: int
    loss_bound: float
    count: str  # "noised" | "public"
    delta: float
    accountant: str
    target_epsilon: float | None = None  # eval.epsilon (None: sigma given)
    steps: tuple[int, ...] = ()  # the steps after which a DP evaluation is released (the last included)

    def __post_init__(self):
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"eval noise_multiplier must be a finite number > 0, got {self.noise_multiplier!r}")
        if self.count not in ("noised", "public"):
            raise ValueError(f"eval.count: {self.count!r} is not one of ['noised', 'public']")
        if not self.loss_bound > 0:
            raise ValueError(f"eval.loss_bound must be > 0, got {self.loss_bound!r}")
        if self.releases < 1:
            raise ValueError(f"a DP evaluation plan needs at least one release, got {self.releases}")

    @property
    def aggregates(self) -> tuple[str, ...]:
        return AGGREGATES if self.count == "noised" else AGGREGATES[:2]

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the scaled vector sum under adding/removing one unit."""
        return math.sqrt(len(self.aggregates))

    @property
    def noise_std(self) -> float:
        """Std of the noise on each scaled aggregate sum."""
        return self.noise_multiplier * self.sensitivity

    def event(self) -> dp_accounting.DpEvent:
        import dp_accounting

        return dp_accounting.GaussianDpEvent(self.noise_multiplier)

    def entries(self) -> list:
        return [(self.event(), self.releases)]

    def expected_std(self, units: int) -> dict:
        """The noise std each released metric will have with ``units`` evaluated units: loss
        L·s/n, accuracy s/n, and both as a fraction of their metric's range (the same
        number: s/n). With ``count: noised`` a release divides by the *noised* count ñ =
        max(1, n + N(0, s²)) (the true n is private), so its stated std is L·s/ñ, not L·s/n:
        L·s/n is then its median, and ``loss_range`` / ``accuracy_range`` (the same keys are
        absent with a public count) are the central 95% of the stds the release will state,
        (L·s/max(1, n + 1.96 s), L·s/max(1, n − 1.96 s)): wide when s is not small against n."""
        n = max(1, int(units))
        s = self.noise_std
        rel = s / n
        out = {"loss": self.loss_bound * rel, "accuracy": rel, "fraction_of_range": rel}
        if self.count == "noised":
            lo, hi = s / max(1.0, n + _Z95 * s), s / max(1.0, n - _Z95 * s)
            out["loss_range"] = (self.loss_bound * lo, self.loss_bound * hi)
            out["accuracy_range"] = (lo, hi)
        return out

    def noise(self) -> tuple[int, int, float]:
        """(releases, noise coordinates per release, noise multiplier relative to the L2
        sensitivity): what the generator's truncated tails cost these releases
        (`DPPlan.eval_noise`; each coordinate is one `keyed_normal` draw)."""
        return (self.releases, len(self.aggregates), self.noise_multiplier)

    def epsilon(self) -> float:
        """ε at δ of all the run's DP evaluations alone."""
        return _acc.epsilon(self.entries(), self.delta, self.accountant)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["steps"] = list(self.steps)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DpEvalPlan:
        return cls(**{**d, "steps": tuple(d.get("steps") or ())})


def plan_dp_eval(*, epsilon: float | None, noise_multiplier: float | None, steps, total_steps: int,
                 loss_bound: float, count: str, delta: float, accountant: str) -> DpEvalPlan:
    """The run's DP evaluation plan: after each of ``steps`` and after the last step, one
    release. With ``epsilon``, the noise multiplier is the smallest (to 0.1%) whose
    composition over all releases is <= epsilon at ``delta`` (dp-accounting's
    ``calibrate_dp_mechanism``); with ``noise_multiplier``, it is used as is."""
    at = tuple(sorted({int(s) for s in steps if 0 < int(s) < total_steps} | {int(total_steps)}))
    r = len(at)
    if noise_multiplier is None:
        import dp_accounting

        if epsilon is None:
            raise ValueError("plan_dp_eval: give epsilon or noise_multiplier")

        def accountant_():
            return _acc.make_accountant(accountant)

        def event(z):
            return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), r)

        if _acc.epsilon([(dp_accounting.GaussianDpEvent(_MIN_Z), r)], delta, accountant) <= epsilon:
            raise ValueError(
                f"eval.epsilon: {epsilon:g} allows a noise multiplier below {_MIN_Z} for {r} DP "
                f"evaluation(s): raise it by lowering eval.epsilon; "
                f"lower eval.epsilon or give eval.noise_multiplier")
        z = dp_accounting.calibrate_dp_mechanism(
            accountant_, event, float(epsilon), float(delta),
            bracket_interval=dp_accounting.LowerEndpointAndGuess(_MIN_Z, 2.0), tol=1e-4)
        noise_multiplier = float(z)
    return DpEvalPlan(noise_multiplier=float(noise_multiplier), releases=r,
                      loss_bound=float(loss_bound), count=count, delta=float(delta),
                      accountant=accountant, target_epsilon=epsilon, steps=at)


def normalized_sums(losses, accuracies, loss_bound: float) -> np.ndarray:
    """[S_loss, S_acc, S_count] in float64: per-unit values clipped to their ranges and
    scaled to [0, 1] (a non-finite loss counts as the bound), summed."""
    loss = np.asarray(losses, dtype=np.float64)
    acc = np.asarray(accuracies, dtype=np.float64)
    loss = np.where(np.isfinite(loss), loss, loss_bound)
    scaled = np.clip(loss, 0.0, loss_bound) / loss_bound
    acc = np.clip(np.where(np.isfinite(acc), acc, 0.0), 0.0, 1.0)
    return np.array([scaled.sum(), acc.sum(), float(loss.size)], dtype=np.float64)


def noisy_sums(sums, plan: DpEvalPlan, key: bytes) -> np.ndarray:
    """The scaled sums plus independent N(0, noise_std²) per released aggregate (the count
    too when it is noised), from the keyed generator (labels: the aggregate's name)."""
    sums = np.asarray(sums, dtype=np.float64).copy()
    for i, name in enumerate(plan.aggregates):
        sums[i] += keyed_normal(key, b"eval/" + name.encode(), plan.noise_std)
    return sums


def release(sums, plan: DpEvalPlan, key: bytes, step: int) -> dict:
    """The published DP evaluation (post-processing of :func:`noisy_sums`): mean loss and
    accuracy (clamped to their ranges), the count used, and the std of each mean's
    numerator noise divided by that count."""
    noisy = noisy_sums(sums, plan, key)
    n = noisy[2] if plan.count == "noised" else float(sums[2])
    n = max(1.0, float(n))
    L = plan.loss_bound
    loss = float(np.clip(L * noisy[0] / n, 0.0, L))
    acc = float(np.clip(noisy[1] / n, 0.0, 1.0))
    return {
        "step": int(step),
        "loss": loss,
        "perplexity": math.exp(loss),
        "accuracy": acc,
        "count": n,
        "count_kind": plan.count,
        "loss_std": L * plan.noise_std / n,
        "accuracy_std": plan.noise_std / n,
        "count_std": plan.noise_std if plan.count == "noised" else 0.0,
        "noise_multiplier": plan.noise_multiplier,
        "loss_bound": L,
        "mechanism": "GaussianDpEvent",
    }
