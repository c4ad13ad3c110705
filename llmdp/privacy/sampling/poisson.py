"""Poisson and truncated Poisson sampling of privacy units from a ChaCha20 keystream.

DESIGN, invariant `sampling-as-accounted`: the sampler must be exactly what the accountant assumes.

* `PoissonSampler` is the sampling of `PoissonSampledDpEvent(q, ...)`: at every step,
  every privacy unit is included independently with probability q. It draws the sample in
  O(B) expected time and memory (B = qN, the expected batch size), whatever N is.
* `ReferencePoissonSampler` (`llmdp.privacy.sampling.reference`) draws the same
  distribution the obvious way, one coin per unit (O(N) per step). It is the test
  reference for `PoissonSampler`, not used in training.
* `TruncatedPoissonSampler` is the sampling of
  `TruncatedSubsampledGaussianDpEvent(N + 1, q, B_max, ...)` for a sampler over N units
  (dp-accounting's size is that of the dataset holding the added unit): the same Poisson
  draw, and when it holds more than B_max units, a uniformly random subset of exactly
  B_max of them.

Randomness. Every draw reads 64-bit words of the ChaCha20 keystream (RFC 8439,
`llmdp.privacy.rng.chacha.words64`) under the step's 32-byte sample key (the worker passes
``chacha.derive_key(step_key, b"sample")``), one stream per purpose, told apart by the
4-byte tag of its nonce (`chacha.stream_nonce`): ``pois`` (the skips of `PoissonSampler`),
``exct`` (the further bits of a coin that the fast comparison leaves undecided, one stream
per coin), ``subs`` (the truncation subset), ``refp`` and ``ties`` (the reference sampler,
a tie's stream indexed by the unit), ``unif`` (`uniform_stream`'s default). With a key
from `secure_key()` (OS entropy) the keystream is computationally indistinguishable from
uniform for anyone who does not know the key; the guarantees below are stated for an
ideal uniform stream. The sample is a deterministic function of the key: words are read
at deterministic positions, so workers agree on a draw without communicating indices
(rank 0 draws a fresh key per step and broadcasts it; every worker expands the same key
to the same sample).

Exactness of `PoissonSampler` (every unit independently with probability exactly q, not
a rounded q; the truncated event needs q itself, its bound is not known to be monotone
in q):

* The gaps between consecutive included units (and before the first) are i.i.d.
  G ~ Geometric(q), P(G = g) = (1-q)**g q; included positions are the partial sums of
  G + 1 from -1, up to N. This is the same law as N independent Bernoulli(q) coins.
* G = m Q + R with m = 2**t, t = floor(log2(1/q)) (capped at 63): Q and R are independent,
  P(Q = j) = rho**j (1 - rho) with rho = (1-q)**m (the number of Bernoulli(rho) successes
  before the first failure), and P(R = r) proportional to (1-q)**r on {0, ..., m-1}, drawn
  by rejection (r from t uniform bits, accepted with probability (1-q)**r). Expected cost:
  m q in (1/2, 1], so rho <= e**-(m q) < e**-1/2 and the acceptance rate (1 - rho) / (m q)
  is > 1 - e**-1: on average < 1 / (1 - e**-1/2) + 2 / (1 - e**-1) < 5.7 words per gap.
  (For q < 2**-63, t = 63 and m > N: Q >= 1 already leaves the units, one word.)
* Every decision is a coin "U < p" with p = (1-q)**s a dyadic rational (q is a binary
  float, 1 - q = c / 2**b exactly) and U a uniform real whose first 64 bits are one
  keystream word W. A float64 approximation f of p (products of the float64 nearest to
  the exact (1-q)**(2**i), computed with Python integers; correctly rounded IEEE
  multiplications only, no log/exp/pow from a math library) has relative error at most
  (1 + 2**-53)**(2t+2) - 1 < `_margin(t)`: W decides the coin when it lies outside
  [f (1 - margin), f (1 + margin)] * 2**64, which is rigorous; otherwise (probability
  about 1e-14) `_exact_coin` reads further bits of U from the coin's own ``exct`` stream
  and compares them with integer lower and upper bounds of p at increasing precision,
  which terminates with probability 1 and decides U < p exactly. Hence each coin has
  probability exactly p, and fresh words make coins independent.

Subsets (`_uniform_subset`) are exactly uniform: each of the n candidates gets a uniform
64-bit word and the `size` smallest are kept, redrawn in the (probability < n 2**-64)
event that the size-th and (size+1)-th smallest words tie; the law is permutation
invariant, so given no tie the chosen set is uniform over all C(n, size) subsets.

Keys (`secure_key`, `seeded_key`, their checks) are `llmdp.privacy.rng.keys`; the rigorous
arithmetic on (1-q)**s behind the coins is `llmdp.privacy.sampling._dyadic`.
"""

from __future__ import annotations

import math

import numpy as np

from llmdp.privacy import rng
from llmdp.privacy.rng import _check_sample_key
from llmdp.privacy.sampling._dyadic import (
    _fast_thresholds,
    _margin,
    _nearest_powers,
    _one_minus,
    _power_bounds,
)

__all__ = [
    "uniform_stream",
    "PoissonSampler",
    "TruncatedPoissonSampler",
    "make_sampler",
]

_CHUNK = 1 << 20  # words per keystream call of the O(N) draws: bounds memory at 8 MiB
_TWO_53 = float(2**53)
_MAX_UNITS = 1 << 62  # partial sums of the gaps stay below 2**63 (int64)
_SKIP_CHUNK = 1 << 18  # gaps drawn per round: bounds the working memory at a few MiB

# Stream tags (the first 4 bytes of a ChaCha20 nonce, `chacha.stream_nonce`).
_TAG_POISSON = b"pois"
_TAG_EXACT = b"exct"
_TAG_SUBSET = b"subs"
_TAG_REFERENCE = b"refp"
_TAG_TIES = b"ties"
_TAG_UNIFORM = b"unif"


# --------------------------------------------------------------------------- ChaCha20 words


def _words(key: bytes, tag: bytes, index: int, first: int, n: int) -> np.ndarray:
    """Words ``first … first + n - 1`` (uint64) of the ChaCha20 stream
    (key, ``tag ‖ index``). The one place sampling reads randomness (tests count it)."""
    return rng.words64(key, rng.stream_nonce(tag, index), first, n)


class _Stream:
    """A cursor on the stream (key, ``tag ‖ 0``): `take(n)` returns the next n words."""

    __slots__ = ("key", "tag", "cursor")

    def __init__(self, key: bytes, tag: bytes):
        self.key, self.tag, self.cursor = key, tag, 0

    def take(self, n: int) -> np.ndarray:
        w = _words(self.key, self.tag, 0, self.cursor, n)
        self.cursor += n
        return w


def uniform_stream(key: bytes, n: int, tag: bytes = _TAG_UNIFORM) -> np.ndarray:
    """`n` float64 uniforms in [0, 1) from the ChaCha20 stream (key, ``tag ‖ 0``).

    Value i is (w_i >> 11) * 2**-53 for word w_i of the stream: k * 2**-53 with k uniform
    on {0, ..., 2**53 - 1}, so the granularity is 2**-53 (every event {u < t} has
    probability within 2**-53 of t). `key` is 32 bytes; `tag` a 4-byte stream tag.
    Deterministic given (key, tag); the first m values do not depend on n >= m.
    """
    key = _check_sample_key(key)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got n={n!r}")
    n = int(n)
    out = np.empty(n, dtype=np.float64)
    for offset in range(0, n, _CHUNK):
        m = min(_CHUNK, n - offset)
        k = _words(key, tag, 0, offset, m) >> np.uint64(11)  # the top 53 of 64 random bits
        out[offset : offset + m] = k * (1.0 / _TWO_53)  # exact: k < 2**53
    return out


# --------------------------------------------------------------------------- validation


def _check_num_units(num_units) -> int:
    if isinstance(num_units, bool) or not isinstance(num_units, (int, np.integer)) or num_units < 1:
        raise ValueError(f"num_units must be an integer >= 1, got num_units={num_units!r}")
    return int(num_units)


def _check_q(sampling_probability) -> float:
    if isinstance(sampling_probability, bool):
        q = math.nan
    else:
        try:
            q = float(sampling_probability)
        except (TypeError, ValueError):
            q = math.nan
    if not (0.0 < q <= 1.0):
        raise ValueError(
            f"sampling_probability must be in (0, 1], got sampling_probability={sampling_probability!r}"
        )
    return q


# --------------------------------------------------------------------------- exact coins


def _exact_coin(c: int, b: int, s: int, w: int, key: bytes, position: int) -> bool:
    """U < (c / 2**b)**s, exactly, for U the uniform real whose bits are the word `w` (the
    word at `position` of the ``pois`` stream) followed by the words of the coin's own
    stream (key, ``exct ‖ position``).

    After k words, U lies in [v / 2**64k, (v + 1) / 2**64k); p = (c / 2**b)**s lies in
    [lo, hi] / 2**prec (`_power_bounds`). Decide when one interval lies on one side of
    the other; else read one more word and raise the precision. p is fixed and U's
    interval shrinks to a point, so this ends with probability 1.
    """
    v, k = w, 1
    guard = b + 2 * s.bit_length() + 64
    while True:
        prec = 64 * k + guard
        lo, hi = _power_bounds(c, b, s, prec)
        shift = prec - 64 * k
        if (v + 1) << shift <= lo:
            return True
        if v << shift >= hi:
            return False
        v = (v << 64) | int(_words(key, _TAG_EXACT, position, k - 1, 1)[0])
        k += 1


# --------------------------------------------------------------------------- Poisson: O(B)


class PoissonSampler:
    """Poisson subsampling of `num_units` privacy units at rate q, in O(qN) expected time.

    Formal guarantee: for a key drawn by `secure_key()` (and ChaCha20 modelled as an ideal
    random stream), `sample(key)` includes every unit independently with probability
    exactly q. This is the sampling `PoissonSampledDpEvent(q, ...)` assumes. Fresh keys
    give independent draws across steps.

    The draw walks the gaps between included units (geometric skips, see the module
    docstring for why every coin is exact), so its expected time and memory are O(qN + 1)
    (a few keystream words per included unit), independent of N: no array of size N is
    ever built. `num_units` may be up to 2**62.

    The batch size |S| ~ Binomial(N, q) is unbounded: memory must be provisioned for
    the largest batch that can occur; `TruncatedPoissonSampler` caps it.

    Same key -> same sample, on every machine (float64 products are correctly rounded
    IEEE operations; no library function enters a decision): this is how workers agree
    on the draw. The key is 32 bytes (a step's sample key, ``chacha.derive_key(step_key,
    b"sample")``). The sample, like the key, is secret (DESIGN, invariant `secrets-stay-secret`): never log either.
    """

    TAG = _TAG_POISSON
    EXACT_TAG = _TAG_EXACT
    #: The cap on the batch size: None, Poisson batches are not capped.
    max_batch_size: int | None = None

    def __init__(self, num_units: int, sampling_probability: float):
        self.num_units = _check_num_units(num_units)
        if self.num_units > _MAX_UNITS:
            raise ValueError(
                f"num_units must be at most 2**62 = {_MAX_UNITS} (positions are int64), "
                f"got num_units={num_units!r}"
            )
        self.sampling_probability = _check_q(sampling_probability)
        q = self.sampling_probability
        if q == 1.0:
            return
        self._c, self._b = _one_minus(q)
        a, den = q.as_integer_ratio()
        # t = floor(log2(1/q)) = floor(log2(floor(1/q))): 2**t <= 1/q < 2**(t+1)
        self._t = t = min((den // a).bit_length() - 1, 63)
        self._m = 1 << t
        # Q >= qcap means G >= m Q >= N: the walk has left the units, Q need not be finished.
        self._qcap = -(-self.num_units // self._m)
        self._powers = _nearest_powers(self._c, self._b, t)  # P_0 .. P_t
        self._margin = _margin(t)
        rho_a, rho_d = _fast_thresholds(np.array([self._powers[t]]), self._margin)
        self._rho_a, self._rho_d = rho_a[0], rho_d[0]  # np.uint64 scalars
        # f(r) = prod over set bits i of r of P_i, from tables of 16-bit chunks of r.
        self._tables = []
        for lo_bit in range(0, t, 16):
            width = min(16, t - lo_bit)
            v = np.arange(1 << width, dtype=np.int64)
            tab = np.ones(1 << width, dtype=np.float64)
            for i in range(width):
                tab = np.where((v >> i) & 1 == 1, tab * self._powers[lo_bit + i], tab)
            self._tables.append(tab)
        if len(self._tables) == 1:  # t <= 16: thresholds per r, looked up
            self._tab_a, self._tab_d = _fast_thresholds(self._tables[0], self._margin)

    @property
    def inclusion_probability(self) -> float:
        """The exact per-unit inclusion probability: q itself (every coin is exact)."""
        return self.sampling_probability

    # ---- the pieces, exposed for the tests

    def _factor(self, r: np.ndarray) -> np.ndarray:
        """f(r) ~ (1-q)**r (float64) for r in [0, 2**t): the product of the P_i over the
        set bits i of r, chunk tables multiplied left to right."""
        r = np.asarray(r, dtype=np.uint64)
        f = None
        for j, tab in enumerate(self._tables):
            part = tab[((r >> np.uint64(16 * j)) & np.uint64(0xFFFF)).astype(np.intp)]
            f = part if f is None else f * part
        return np.ones(r.shape, dtype=np.float64) if f is None else f

    def _thresholds(self, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(self._tables) == 1:
            ri = r.astype(np.intp)
            return self._tab_a[ri], self._tab_d[ri]
        return _fast_thresholds(self._factor(r), self._margin)

    def _coins(self, key: bytes, w: np.ndarray, first: int, a, d, s) -> np.ndarray:
        """Coins "U_i < (1-q)**s_i" for the words w (at positions first + i of the
        ``pois`` stream): decided by the thresholds (a, d), else exactly (`_exact_coin`)."""
        win = w < a
        open_ = ~win & (w <= d)
        if open_.any():
            for i in np.flatnonzero(open_).tolist():
                s_i = s if isinstance(s, int) else int(s[i])
                win[i] = _exact_coin(self._c, self._b, s_i, int(w[i]), key, first + i)
        return win

    def _skips(self, key: bytes, stream: _Stream, k: int) -> np.ndarray:
        """k i.i.d. gaps G ~ Geometric(q) (int64), each replaced by N when it is >= N."""
        n_units, m, qcap, t = self.num_units, self._m, self._qcap, self._t
        # Q: Bernoulli(rho) successes before the first failure, in rounds over the pending.
        big_q = np.empty(k, dtype=np.int64)
        idx = np.arange(k, dtype=np.int64)
        j = 0
        while idx.size and j < qcap:
            first = stream.cursor
            go_on = self._coins(key, stream.take(idx.size), first, self._rho_a, self._rho_d, m)
            big_q[idx[~go_on]] = j
            idx = idx[go_on]
            j += 1
        big_q[idx] = j  # only when j == qcap: G >= N, beyond the last unit
        beyond = big_q >= qcap
        # R on {0..m-1}, P(R = r) ~ (1-q)**r: r from t bits, accepted with prob (1-q)**r.
        r_all = np.zeros(k, dtype=np.int64)
        if t:
            idx = np.flatnonzero(~beyond)
            shift = np.uint64(64 - t)
            while idx.size:
                n = idx.size
                first = stream.cursor
                w = stream.take(2 * n)
                r = w[:n] >> shift
                a, d = self._thresholds(r)
                keep = self._coins(key, w[n:], first + n, a, d, r)
                r_all[idx[keep]] = r[keep].astype(np.int64)  # r < 2**63
                idx = idx[~keep]
        with np.errstate(over="ignore"):  # overflow only in the discarded (beyond) entries
            g = r_all if t == 63 else r_all + big_q * np.int64(m)  # t = 63: qcap = 1, Q = 0
        return np.minimum(np.where(beyond, n_units, g), n_units)

    def sample(self, key: bytes) -> np.ndarray:
        """Sorted int64 indices of the units included in this step's sample."""
        key = _check_sample_key(key)
        n_units, q = self.num_units, self.sampling_probability
        if q == 1.0:
            return np.arange(n_units, dtype=np.int64)
        stream = _Stream(key, self.TAG)
        parts, last = [], -1  # included positions are -1 + partial sums of (G + 1)
        while True:
            mean = int((n_units - 1 - last) * q)  # IEEE product, truncated: deterministic
            k = min(mean + 6 * math.isqrt(mean) + 16, _SKIP_CHUNK)
            # partial sums stay below 2N + 1 <= 2**63 up to the first one >= N
            pos = np.cumsum(self._skips(key, stream, k) + 1) + last
            out = pos >= n_units
            if out.any():
                parts.append(pos[: int(np.argmax(out))])
                break
            parts.append(pos)
            last = int(pos[-1])
        return np.concatenate(parts)

    def sample_with_info(self, key: bytes) -> tuple[np.ndarray, bool]:
        """(`sample(key)`, False): the common interface with `TruncatedPoissonSampler`."""
        return self.sample(key), False


# --------------------------------------------------------------------------- truncation


def _uniform_subset(key: bytes, tag: bytes, n: int, size: int) -> np.ndarray:
    """Sorted positions (int64) of a uniformly random `size`-subset of {0, ..., n-1}.

    Exactly uniform over all C(n, size) subsets (for an ideal stream), in O(n) time and
    memory with no Python loop: position i gets word i of the stream (key, ``tag ‖ 0``),
    the `size` smallest words are kept (`np.argpartition`). The law of the words is
    invariant under permuting positions, and so is the event E that the size-th and
    (size+1)-th smallest words differ (then the kept set is well defined); so given E the
    kept set is uniform. When E fails (probability < n 2**-64) the next n words of the
    stream are drawn instead.
    """
    if not (0 <= size <= n):
        raise ValueError(f"size must be in [0, n={n}], got size={size}")
    if size == n:
        return np.arange(n, dtype=np.int64)
    if size == 0:
        return np.empty(0, dtype=np.int64)
    first = 0
    while True:
        w = _words(key, tag, 0, first, n)
        first += n
        part = np.argpartition(w, size)  # part[:size]: the size smallest; part[size]: the next
        if w[part[:size]].max() < w[part[size]]:
            return np.sort(part[:size]).astype(np.int64, copy=False)


class TruncatedPoissonSampler:
    """Poisson subsampling at rate q, capped at `max_batch_size` = B_max units.

    Formal guarantee: for a key drawn by `secure_key()` (and ChaCha20 modelled as an
    ideal random stream), `sample(key)` is distributed as follows. S is the Poisson
    draw of `PoissonSampler(num_units, q).sample(key)` (every unit independently with
    probability exactly q; the *same* S for the same key). If |S| <= B_max the sample is
    S; otherwise it is a subset of S of size exactly B_max, uniformly random over all
    C(|S|, B_max) subsets (exactly: `_uniform_subset`), drawn from the same key's stream
    tagged ``subs``, independently of which units S holds. This is the sampling
    `TruncatedSubsampledGaussianDpEvent(num_units, q, B_max, sigma)` assumes, so
    `num_units` must be the dataset size N of that event (the plan's). Fresh keys give
    independent draws across steps. O(qN + B_max) expected time, independent of N.

    The batch has at most B_max units: the caller provisions, and pads its compute to,
    B_max units per step ("pad below it"); units beyond B_max are never processed.

    Same key -> same sample, on every machine. The sample and the key are secret
    (DESIGN, invariant `secrets-stay-secret`): never log them. Whether a step was truncated is computed on private
    data: it may only appear among the metrics the report marks internal.
    """

    SUBSET_TAG = _TAG_SUBSET

    def __init__(self, num_units: int, sampling_probability: float, max_batch_size: int):
        self._poisson = PoissonSampler(num_units, sampling_probability)
        if (
            isinstance(max_batch_size, bool)
            or not isinstance(max_batch_size, (int, np.integer))
            or max_batch_size < 1
        ):
            raise ValueError(
                f"max_batch_size must be an integer >= 1 (the cap B_max on units per step), "
                f"got max_batch_size={max_batch_size!r}"
            )
        self.num_units = self._poisson.num_units
        self.sampling_probability = self._poisson.sampling_probability
        self.max_batch_size = int(max_batch_size)

    @property
    def inclusion_probability(self) -> float:
        """q: the per-unit probability of the Poisson draw, before the cap."""
        return self._poisson.inclusion_probability

    def sample(self, key: bytes) -> np.ndarray:
        """Sorted int64 indices of this step's sample: at most `max_batch_size` of them."""
        return self.sample_with_info(key)[0]

    def sample_with_info(self, key: bytes) -> tuple[np.ndarray, bool]:
        """(indices, truncated): `truncated` says whether the Poisson draw exceeded B_max.

        `truncated` is computed on private data (it reveals |S| > B_max): it is as
        secret as the sample, and is neither logged nor reported unless privatized.
        """
        drawn = self._poisson.sample(key)
        if len(drawn) <= self.max_batch_size:
            return drawn, False
        keep = _uniform_subset(key, self.SUBSET_TAG, len(drawn), self.max_batch_size)
        return drawn[keep], True


def make_sampler(
    num_units: int, sampling_probability: float, max_batch_size: int | None = None
) -> PoissonSampler | TruncatedPoissonSampler:
    """`PoissonSampler` if `max_batch_size` is None, else `TruncatedPoissonSampler`."""
    from llmdp.base import (
        plants as plant,  # the test-only switch (LLMDP_TEST_PLANT), never a recipe
    )

    if plant.on("fixed-batches"):  # a planted bug for the auditor's self-test
        return plant.FixedBatches(num_units, sampling_probability)
    if max_batch_size is None:
        return PoissonSampler(num_units, sampling_probability)
    return TruncatedPoissonSampler(num_units, sampling_probability, max_batch_size)
