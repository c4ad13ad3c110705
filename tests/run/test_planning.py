"""`llmdp.run.planning`: the plan's mechanism config from the recipe (issue 53)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmdp.config.schema import load_recipe, lr_lambda
from llmdp.privacy.mechanism import BandedMf, Blt, DpSgd
from llmdp.privacy.plan import make_plan
from llmdp.run.planning import _mechanism

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"


def _plan(cfg, mechanism):
    p = cfg.privacy
    return make_plan(dataset_size=600, expected_batch_size=cfg.train.expected_batch_size,
                     max_grad_norm=p.max_grad_norm, steps=cfg.train.steps, delta=1e-4,
                     noise_multiplier=1.3, accountant=p.accountant, sampler=p.sampler,
                     mechanism=mechanism)


@pytest.mark.parametrize("overrides,direct", [
    ([], lambda cfg, cache, lrs: DpSgd()),
    (["privacy.mechanism=banded-mf", "privacy.sampler=cyclic-poisson", "privacy.bands=2"],
     lambda cfg, cache, lrs: BandedMf(bands=2, strategy_cache=cache)),
    (["privacy.mechanism=banded-mf", "privacy.sampler=fixed-cycle", "privacy.bands=2",
      "optim.name=sgd", "optim.momentum=0.5"],
     lambda cfg, cache, lrs: BandedMf(bands=2, momentum=0.5, learning_rates=lrs, strategy_cache=cache)),
    (["privacy.mechanism=blt", "privacy.sampler=fixed-cycle", "privacy.buffers=2", "privacy.cycle=4"],
     lambda cfg, cache, lrs: Blt(buffers=2, cycle=4, strategy_cache=cache)),
])
def test_the_recipe_makes_the_plan_its_mechanism_config_makes(tmp_path, overrides, direct):
    """The recipe's privacy fields are read into the mechanism's config by name (and the
    workload from optim: SGD's momentum and learning rates); the plan equals the one built
    from the config written out by hand."""
    cfg = load_recipe(RECIPE, ["train.steps=8", "train.expected_batch_size=20", *overrides])
    from_recipe = _plan(cfg, _mechanism(cfg, str(tmp_path)))
    f = lr_lambda(cfg.optim, cfg.train.steps)
    by_hand = direct(cfg, str(tmp_path / "mf"), [float(f(t)) for t in range(cfg.train.steps)])
    assert _plan(cfg, by_hand) == from_recipe
    assert by_hand.mechanism == cfg.privacy.mechanism == from_recipe.mechanism
