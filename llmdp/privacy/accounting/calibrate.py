"""Noise calibration: the one sigma search, and the curves and compositions it runs on.

`calibrate_sigma` is the generic search, in the spirit of dp-accounting's
`calibrate_dp_mechanism`: given epsilon(sigma), non-increasing in sigma, and a target, it
memoizes the evaluations (each is a whole PLD or RDP composition), brackets the root by
a geometric walk, solves with Brent's method (`scipy.optimize.brentq`, on sigma or on
log sigma) and returns a sigma on the side that meets the target: epsilon(sigma) <=
target is checked, never assumed, and sigma is nudged up if ever needed.

Its users: `calibrate_curve` (sigma of a DP-SGD plan, `plan.calibrate_noise` and
`make_plan`), the truncated-Poisson planner (`truncation.plan_truncated`) and
`prior.calibrate_with_prior` (sigma raised so that earlier releases on the same units and
the whole training compose to the target).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from llmdp.config.choices import Accountant
from llmdp.privacy.accounting.events import dpsgd_step_event
from llmdp.privacy.accounting.grids import PLD_DISPLAY_DISCRETIZATION_INTERVAL

__all__ = [
    "SIGMA_RTOL",
    "PlanError",
    "EpsilonCurve",
    "Memo",
    "calibrate_sigma",
    "calibrate_curve",
    "round_up",
    "solve",
]

# Calibration tolerance on sigma, relative. Epsilon is smooth in sigma with
# |d log eps / d log sigma| of order 1-3 in the DP-SGD regime, so 1e-5 relative on sigma
# keeps the calibrated epsilon within ~1e-4 relative of the target. Two searches of one
# plan (another version of the search, another machine's last bits of dp-accounting's FFT)
# may then differ by up to twice this (`record.rundir.RunDir.first_plan`).
SIGMA_RTOL = 1e-5

# The PLD grid of the planner's searches (B_max, and sigma under the truncated event):
# ~10x faster than the reporting grid `grids.PLD_VALUE_DISCRETIZATION_INTERVAL`, and
# pessimistic like it. Every number a plan carries is recomputed on the reporting grid.
_SEARCH_INTERVAL = PLD_DISPLAY_DISCRETIZATION_INTERVAL
#
# The accountant (dp-accounting, scipy: ~1 CPU-s of imports) is imported by the functions
# that evaluate ε, not with this module: a training worker loads it (through the run's
# plan) and never calibrates.


class PlanError(ValueError):
    """An invalid or unreachable DP plan; the message names the field, value and fix."""


def knobs_message() -> str:
    return (
        "To make it reachable: fewer steps/epochs, a smaller expected batch size "
        "(smaller sampling probability q), a larger dataset, a larger target_epsilon, "
        "or a larger delta (still below 1/N)."
    )


# ---- the generic search


class Memo:
    """epsilon(sigma), memoized on float(sigma): the search re-evaluates bracket ends and
    its final root, and each evaluation is a whole composition."""

    def __init__(self, eps: Callable[[float], float]):
        self._eps = eps
        self._values: dict[float, float] = {}

    def __call__(self, sigma: float) -> float:
        sigma = float(sigma)
        if sigma not in self._values:
            self._values[sigma] = float(self._eps(sigma))
        return self._values[sigma]


def bracket(eps, target: float, start: float, max_sigma: float, factor: float, *,
            accelerate: bool = False, walk_down: bool = True):
    """(lo, hi) with eps(lo) > target >= eps(hi) and eps(lo) finite, walking geometrically
    from `start` (with `accelerate`, the factor squares after each step: small steps
    first for a close guess, few steps for a far one); (None, hi) if eps stays <= target
    down to a vanishing sigma, or, without `walk_down`, if eps(start) <= target already.

    eps(max_sigma) <= target must hold (`calibrate_sigma` checks it).
    """
    lo = lo_value = None
    hi = min(start, max_sigma)
    value = eps(hi)
    up = factor
    while value > target:  # start is infeasible: walk up
        lo, lo_value = hi, value
        hi = min(hi * up, max_sigma)
        value = eps(hi)
        if accelerate:
            up = up * up
    if lo is not None and math.isfinite(lo_value):
        return lo, hi
    if not walk_down:
        return None, hi
    floor = hi * 1e-6
    while True:  # hi is feasible: walk down until infeasible
        cand = hi / factor
        if cand < floor:
            return None, hi
        value = eps(cand)
        if value <= target:
            hi = cand
            if accelerate:
                factor = factor * factor
        elif math.isfinite(value):
            return cand, hi
        else:
            # Infinite epsilon makes Brent's interpolation meaningless: step more gently.
            factor = math.sqrt(factor)
            if factor < 1.0 + 1e-9:
                # eps <= target down to a wall below which it is infinite (the noise tails
                # spend δ there, `EpsilonCurve.delta_at`): hi, feasible, is the answer.
                return None, hi


def _bisect(gap, lo: float, hi: float, tol: float) -> float:
    """A point with gap <= 0 within tol of the root, gap(lo) > 0 >= gap(hi)."""
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if gap(mid) <= 0:
            hi = mid
        else:
            lo = mid
    return hi


def solve(eps, target: float, lo: float, hi: float, *, rtol: float, log: bool = False) -> float:
    """The root of eps(sigma) = target in the bracket [lo, hi] by Brent's method, with a
    non-positive gap eps - target, as `calibrate_dp_mechanism` returns it: on sigma with
    tolerance rtol * lo, or (`log`) on log sigma with tolerance rtol."""
    if log:
        def gap(x):
            return eps(math.exp(x)) - target

        a, b, tol = math.log(lo), math.log(hi), rtol
    else:
        def gap(x):
            return eps(x) - target

        a, b, tol = lo, hi, rtol * lo
    from scipy.optimize import brentq

    root, result = brentq(gap, a, b, xtol=tol, full_output=True)
    if not result.converged:
        root = None
    elif gap(root) > 0:  # within tol of a root: first try its neighbours
        if gap(root + tol) < 0:
            root += tol
        elif gap(root - tol) < 0:
            root -= tol
        else:
            root = None
    if root is None:
        root = _bisect(gap, a, b, tol)
    return math.exp(root) if log else root


def round_up(eps, target: float, sigma: float, step: float = SIGMA_RTOL) -> float:
    """sigma, nudged up geometrically (relative `step`, doubling) until eps(sigma) <= target."""
    for _ in range(60):
        if eps(sigma) <= target:
            return sigma
        sigma *= 1.0 + step
        step *= 2.0  # geometric: a few evaluations even if the root was far off
    raise PlanError(f"calibration failed to reach target_epsilon={target:g} near sigma={sigma:g}")


def calibrate_sigma(
    eps: Callable[[float], float],
    target: float,
    *,
    start: float,
    factor: float,
    rtol: float = SIGMA_RTOL,
    max_sigma: float = math.inf,
    accelerate: bool = False,
    walk_down: bool = True,
    log: bool = False,
    check: bool = True,
    unreachable: Callable[[float], Exception] | None = None,
) -> float:
    """The smallest sigma with eps(sigma) <= target, to relative `rtol`.

    `eps` is non-increasing in sigma; its evaluations are memoized. If `max_sigma` is
    finite and eps(max_sigma) > target, raises `unreachable(eps(max_sigma))` (default: a
    `PlanError`). The root is bracketed from `start` (`bracket`: step `factor`,
    `accelerate`, `walk_down`), solved (`solve`, on log sigma with `log`) and, with
    `check`, nudged up until eps(sigma) <= target (`round_up`): the returned sigma then
    meets the target. If eps(start) <= target and it stays so down to a vanishing sigma
    (or without `walk_down`), the feasible end of the walk is returned as is.
    """
    eps = eps if isinstance(eps, (Memo, EpsilonCurve)) else Memo(eps)
    if math.isfinite(max_sigma):
        top = eps(max_sigma)
        if top > target:
            if unreachable is not None:
                raise unreachable(top)
            raise PlanError(f"target_epsilon={target:g} is unreachable: epsilon at "
                            f"max_noise_multiplier={max_sigma:g} is {top:.4g}")
    lo, hi = bracket(eps, target, start, max_sigma, factor, accelerate=accelerate,
                     walk_down=walk_down)
    if lo is None:
        return hi
    sigma = solve(eps, target, lo, hi, rtol=rtol, log=log)
    return round_up(eps, target, sigma, rtol) if check else sigma


# ---- DP-SGD: epsilon of T Poisson (or truncated Poisson) steps, as a function of sigma


class EpsilonCurve:
    """epsilon(sigma) for fixed (q, T, delta, accountant[, N, B_max][, grid]), memoized.

    A PLD evaluation costs ~1 s at T~2000 (several seconds for the truncated event) and
    the search re-evaluates the bracket endpoints and its final root; the memo makes
    those repeats free. The values are exactly those `accountant.epsilon_for` returns
    (or `accountant.epsilon_estimate` on `interval`).

    `delta_at(sigma)`, if given, is the δ the accountant runs at for that sigma (the
    published `delta` less the noise generator's tails, which shrink as sigma grows:
    `noise_tail`); the curve stays non-increasing in sigma (a larger sigma lowers ε at a
    fixed δ and raises δ_accountant), and is inf where nothing of δ is left.
    """

    def __init__(
        self,
        q: float,
        steps: int,
        delta: float,
        accountant: str,
        *,
        dataset_size: int | None = None,
        max_batch_size: int | None = None,
        interval: float | None = None,
        delta_at: Callable[[float], float] | None = None,
    ):
        self.q, self.steps, self.delta, self.accountant = q, steps, delta, accountant
        self.dataset_size, self.max_batch_size, self.interval = dataset_size, max_batch_size, interval
        self.delta_at = delta_at
        self._values: dict[float, float] = {}

    def delta_for(self, sigma: float) -> float:
        """The accountant's δ at `sigma`."""
        return self.delta if self.delta_at is None else float(self.delta_at(float(sigma)))

    def _kwargs(self) -> dict:
        if self.max_batch_size is None:
            return {}
        return {"dataset_size": self.dataset_size, "max_batch_size": self.max_batch_size}

    def __call__(self, sigma: float) -> float:
        sigma = float(sigma)
        if sigma not in self._values:
            from llmdp.privacy.accounting import accountant as _acc

            delta = self.delta_for(sigma)
            if delta <= 0:
                value = math.inf  # the noise tails alone spend δ at this sigma
            elif self.interval is None:
                value = _acc.epsilon_for(
                    self.q, sigma, self.steps, delta, self.accountant, **self._kwargs()
                )
            else:
                assert self.accountant == Accountant.PLD, "a grid is a PLD setting"
                value = _acc.epsilon_estimate(
                    self.q, sigma, self.steps, delta,
                    value_discretization_interval=self.interval, **self._kwargs(),
                )
            self._values[sigma] = value
        return self._values[sigma]


# The orders of the RDP bound that only tells the PLD search where to start: dp-accounting's
# RDP of a large integer order sums that many terms one by one (the reporting orders,
# `accountant.RDP_ORDERS`, up to 8192: ~0.3 s per sigma); these cost ~0.015 s. Fewer orders
# give a larger epsilon, so the start is, if anything, further above the PLD root (the
# side the PLD search may start from); orders up to 256 suffice down to epsilon ~ 0.06 at
# delta = 1e-6, and a start above the root only costs a few more steps on the search grid.
# (Not a cheap curve for an RDP search itself: which order is best changes with sigma, and
# the two curves' difference with it; tried, it took more evaluations, not fewer.)
_START_ORDERS = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0,
                 14.0, 16.0, 20.0, 24.0, 28.0, 32.0, 40.0, 48.0, 56.0, 64.0, 96.0, 128.0,
                 192.0, 256.0)


def _rdp_upper_bound(curve: EpsilonCurve, sigma: float) -> float:
    """epsilon of `curve`'s Poisson steps (no cap) by RDP at `_START_ORDERS`, at
    `curve`'s δ at sigma: an upper bound of `curve`'s Poisson epsilon, cheap."""
    delta = curve.delta_for(sigma)
    if delta <= 0:
        return math.inf
    from dp_accounting.rdp import RdpAccountant

    from llmdp.privacy.accounting import accountant as _acc

    acc = RdpAccountant(_START_ORDERS, _acc.NEIGHBORING_RELATION)
    acc.compose(dpsgd_step_event(curve.q, sigma), curve.steps)
    return float(acc.get_epsilon(delta))


def _close_to_the_root(curve: EpsilonCurve, cheap: EpsilonCurve, target: float, *,
                       start: float, factor: float, max_sigma: float) -> float | None:
    """A sigma close to the root of `curve`, found mostly on `cheap`, a curve of the same
    quantity that costs far less per sigma (the PLD search grid's, ~10x): `cheap`'s root
    (bracketed from `start` by `factor`), then the root of `cheap` shifted by the two
    curves' difference at the last sigma (one evaluation of `curve`
    each; the difference varies slowly with sigma), until two roots agree to rtol/2. None
    if `cheap` cannot help (it cannot reach the target, or `curve` is infinite there). Only
    where to start: the root is then bracketed and solved on `curve` itself and the answer
    checked, as from any start."""
    try:
        sigma = calibrate_sigma(cheap, target, start=start, factor=factor, rtol=SIGMA_RTOL,
                                max_sigma=max_sigma, check=False)
        for _ in range(4):
            value = curve(sigma)
            if not math.isfinite(value):
                return None
            shifted = calibrate_sigma(cheap, target + (cheap(sigma) - value), start=sigma,
                                      factor=1.0 + 10 * SIGMA_RTOL, accelerate=True,
                                      rtol=SIGMA_RTOL / 10, max_sigma=max_sigma, check=False)
            if abs(shifted - sigma) <= sigma * SIGMA_RTOL / 2:
                break
            sigma = shifted
        return sigma
    except PlanError:
        return None


def calibrate_curve(curve: EpsilonCurve, target: float, max_sigma: float,
                    start: float | None = None) -> float:
    """The smallest sigma <= max_sigma with curve(sigma) <= target (`calibrate_sigma`,
    relative tolerance 1e-5, checked); `start` is a close guess of the root (then the
    bracket walks from it in small, growing steps). Raises `PlanError` naming the knobs
    if even max_sigma is above target."""

    def unreachable(eps_max: float) -> PlanError:
        cap = "" if curve.max_batch_size is None else f", max_batch_size={curve.max_batch_size}"
        knobs = knobs_message()
        if curve.max_batch_size is not None:
            knobs += " With truncated Poisson sampling: a larger max_batch_size."
        return PlanError(
            f"target_epsilon={target:g} is unreachable with these numbers: even the largest "
            f"noise multiplier tried, max_noise_multiplier={max_sigma:g}, gives epsilon={eps_max:.4g} "
            f"(sampling probability q={curve.q:.6g}, steps={curve.steps}, delta={curve.delta:g}"
            + ("" if curve.delta_at is None else
               f" (the accountant's: {curve.delta_for(max_sigma):.6g}, less the noise tails)")
            + ", "
            f"accountant={curve.accountant!r}{cap}). " + knobs
        )

    eps_max = curve(max_sigma)
    if eps_max > target:
        raise unreachable(eps_max)
    # Where to start the bracket. PLD cost and memory explode as sigma -> 0 (sigma=0.1 at
    # q=0.01, T=2000 asks for >20 GiB), so PLD must never probe far below the answer:
    # locate it first, loosely, with the cheap RDP accountant (an upper bound of the same
    # quantity, so usually a slightly larger sigma), then walk from there in small
    # geometric steps with PLD.
    if start is not None:
        kw = dict(start=start, factor=1.01, accelerate=True)
    elif curve.accountant == Accountant.PLD:
        rdp = Memo(functools.partial(_rdp_upper_bound, curve))
        if rdp(max_sigma) <= target:
            guess = calibrate_sigma(rdp, target, start=1.0, factor=2.0, rtol=1e-2,
                                    max_sigma=max_sigma, check=False)
        else:  # RDP cannot reach the target but PLD can: start from the top.
            guess = max_sigma
        kw = dict(start=guess, factor=1.1)
        if curve.interval is None:  # the reporting grid: the search grid tells where
            coarse = EpsilonCurve(curve.q, curve.steps, curve.delta, curve.accountant,
                                  dataset_size=curve.dataset_size,
                                  max_batch_size=curve.max_batch_size,
                                  interval=_SEARCH_INTERVAL, delta_at=curve.delta_at)
            close = _close_to_the_root(curve, coarse, target, start=guess, factor=1.1,
                                       max_sigma=max_sigma)
            if close is not None:
                kw = dict(start=close, factor=1.0 + SIGMA_RTOL, accelerate=True)
    else:
        kw = dict(start=1.0, factor=2.0)
    return calibrate_sigma(curve, target, rtol=SIGMA_RTOL, max_sigma=max_sigma,
                           unreachable=unreachable, **kw)
