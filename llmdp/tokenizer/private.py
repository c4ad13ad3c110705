"""A tokenizer trained on *private* text, with a differential-privacy guarantee.

A tokenizer's vocabulary is a function of its training text (a piece for a rare surname
says the surname is in the corpus; DP-fy guide §5.5), so SentencePiece / WordPiece must
not see private text directly. This module privatizes what they *do* need, the word
frequency table, and trains SentencePiece on the released table only (post-processing):

1. **Pre-tokenization** (`pre_tokenize`): Unicode whitespace split (``str.split()``) of
   the raw text (no normalization: the trained SentencePiece model uses identity
   normalization too), the same "words" SentencePiece forms itself (its pieces never
   cross whitespace; punctuation / digits are separated inside a word by its own
   ``split_by_unicode_script`` / ``split_by_number`` rules). Words longer than
   `MAX_WORD_CHARS` characters are truncated to that length.
2. **Contribution bounding** (`bound_unit_words`): a privacy unit contributes at most K
   *distinct* words, each counted once. Which K: the unit's distinct words sorted by a
   keyed hash of the word (BLAKE2b keyed by a subkey of `key`), the first K kept. The
   choice depends only on the unit's own words and the key, never on other units.
3. **Gaussian noise** (`word_noise`): every word that occurs in some unit gets
   N(0, sigma^2) added to its count, drawn by `llmdp.privacy.noise.gaussian.keyed_normal` (ChaCha20
   under a per-word key derived from (key, word)), so one word's noise is a deterministic
   function of (key, word) alone and independent across words. (The same floating-point
   Box-Muller sampler and caveats as the gradient noise.)
4. **Threshold**: words whose noisy count is > tau are released, with the integer count
   max(1, round(noisy)); everything else is dropped.

Privacy (add-or-remove-one privacy unit; the "Gaussian partition selection" / DP set
union mechanism): let D = D' + one unit u. The released vector over words present in D'
is the Gaussian mechanism on a count vector of L2 sensitivity <= sqrt(K) (u adds 1 to at
most K words), thresholded (post-processing): `GaussianDpEvent(sigma / sqrt(K))`. The
words only u holds (at most K) are released with probability
p_i = P(1 + N(0, sigma^2) > tau) each, so some is released with probability at most
delta_threshold = K * Phi_bar((tau - 1) / sigma) (union bound). With E = "no u-only word
released", the output under D is (1 - p) * [Gaussian mechanism output] + p * [anything],
p <= delta_threshold, and under D' it is the Gaussian mechanism's. For any composition
with later (adaptive) mechanisms C whose PLD-accounted curve, together with the Gaussian
event, is delta_C(eps):

* add direction:    H_{e^eps}(P_D || P_D') <= delta_C(eps) + p
* remove direction: H_{e^eps}(P_D' || P_D) <= delta_C(eps + log(1 - p))

hence at a target delta the whole composition is (eps, delta)-DP with
``eps = eps_C(delta - delta_threshold) - log(1 - delta_threshold)``
(`llmdp.privacy.accounting.accountant.epsilon_with_threshold`). dp-accounting 0.6 has no event for "plus delta" (no
``EpsilonDeltaDpEvent``; its PLD accountant accepts none that is exactly an (0, delta)
mechanism), so the ledger records the Gaussian event and stores delta_threshold in the
record's ``extra`` (`ledger_extra`): **a report must use `accountant.epsilon_with_threshold`
with `Ledger.delta_threshold()` over such a ledger, never the plain epsilon.**

Seeded keys (`llmdp.privacy.rng.keys.seeded_key`) are for tests only (DESIGN, invariant `secrets-stay-secret`); a real
run uses `secure_key()`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping

import dp_accounting
import numpy as np
from scipy.stats import norm

from llmdp._fs import building_dir, replace_dir
from llmdp.config.choices import Accountant
from llmdp.config.validate import _check_positive
from llmdp.privacy.accounting import calibrate_sigma, epsilon
from llmdp.privacy.noise import keyed_normal
from llmdp.privacy.rng import _check_key
from llmdp.tokenizer.public import _make_portable

__all__ = [
    "SPECIAL_TOKENS",
    "MAX_WORD_CHARS",
    "DEFAULT_DELTA_THRESHOLD_FRACTION",
    "pre_tokenize",
    "unit_words",
    "units_from_records",
    "bound_unit_words",
    "word_noise",
    "dp_word_counts",
    "calibrate_tokenizer_noise",
    "threshold_delta",
    "tokenizer_event",
    "ledger_extra",
    "train_sentencepiece_from_counts",
]

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")  # ids 0-3, as the public tokenizer
MAX_WORD_CHARS = 64
# delta is split delta_gauss = (1 - f) * delta, delta_threshold = f * delta.
DEFAULT_DELTA_THRESHOLD_FRACTION = 0.5

_ORDER_DOMAIN = b"llmdp.tokenizer.order.v1"
_NOISE_DOMAIN = b"llmdp.tokenizer.word_noise.v1"


# ----------------------------------------------------------------------------- words


def pre_tokenize(text: str) -> list[str]:
    """The words of `text`: Unicode whitespace split (``str.split()``), each cut to
    MAX_WORD_CHARS characters."""
    return [w[:MAX_WORD_CHARS] for w in text.split()]


def unit_words(texts: str | Iterable[str]) -> list[str]:
    """All words of one privacy unit (one text, or the texts of one unit)."""
    if isinstance(texts, str):
        texts = [texts]
    out: list[str] = []
    for t in texts:
        out.extend(pre_tokenize(t))
    return out


def units_from_records(records, *, text_field: str = "text", unit_field: str | None = None) -> list[list[str]]:
    """The words of each privacy unit of `records` (e.g. `llmdp.data.sources.load_records`
    output, or a list of dicts): one unit per record, or, with `unit_field` (e.g.
    "user_id"), one unit per distinct value of that field (all its records' texts)."""
    if unit_field is None:
        return [unit_words(r[text_field] or "") for r in records]
    groups: dict = {}
    for r in records:
        groups.setdefault(r[unit_field], []).extend(pre_tokenize(r[text_field] or ""))
    return list(groups.values())


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"max_words_per_unit must be an integer >= 1, got {k!r}")
    return int(k)


def _order_key(key: bytes) -> bytes:
    return hashlib.sha256(_ORDER_DOMAIN + _check_key(key)).digest()


def _word_rank(order_key: bytes, word: str) -> bytes:
    return hashlib.blake2b(word.encode("utf-8"), key=order_key, digest_size=16).digest()


def bound_unit_words(words: Iterable[str], max_words_per_unit: int, key: bytes) -> list[str]:
    """At most K distinct words of one unit: its distinct words ordered by a keyed
    BLAKE2b hash of the word (key derived from `key`), the first K. Depends only on this
    unit's words and the key (contribution bounding independent of other units)."""
    k = _check_k(max_words_per_unit)
    ok = _order_key(key)
    distinct = set(words)
    if len(distinct) <= k:
        return sorted(distinct, key=lambda w: _word_rank(ok, w))
    return sorted(distinct, key=lambda w: _word_rank(ok, w))[:k]


def word_noise(key: bytes, word: str, std: float) -> float:
    """One N(0, std^2) draw, a deterministic function of (key, word):
    `llmdp.privacy.noise.gaussian.keyed_normal` with label = domain + UTF-8 word (ChaCha20 under a
    per-word key; Box-Muller on a 106-bit radius uniform and a 53-bit angle)."""
    return keyed_normal(_check_key(key), _NOISE_DOMAIN + word.encode("utf-8"), std)


def dp_word_counts(
    units_words: Iterable[Iterable[str]],
    *,
    max_words_per_unit: int,
    noise_multiplier: float,
    threshold: float,
    key: bytes,
) -> dict[str, int]:
    """DP word counts (Gaussian partition selection), see the module docstring.

    `units_words`: one iterable of words per privacy unit (e.g. `unit_words(texts)`).
    `noise_multiplier` is sigma, the std of the noise on each count (the Gaussian
    mechanism's multiplier is sigma / sqrt(K)); `threshold` is tau. Returns
    {word: max(1, round(count + noise))} for the words whose noisy count > tau.
    """
    k = _check_k(max_words_per_unit)
    sigma = _check_positive("noise_multiplier", noise_multiplier)
    tau = float(threshold)
    if not math.isfinite(tau):
        raise ValueError(f"threshold must be finite, got threshold={threshold!r}")
    key = _check_key(key)
    counts: dict[str, int] = {}
    for words in units_words:
        if isinstance(words, str):
            raise TypeError("each unit must be an iterable of words, not a str (use unit_words)")
        for w in bound_unit_words(words, k, key):
            counts[w] = counts.get(w, 0) + 1
    out: dict[str, int] = {}
    for w in sorted(counts):
        noisy = counts[w] + word_noise(key, w, sigma)
        if noisy > tau:
            out[w] = max(1, int(round(noisy)))
    return out


# ----------------------------------------------------------------------------- accounting


def threshold_delta(noise_multiplier: float, threshold: float, max_words_per_unit: int) -> float:
    """delta_threshold = K * Phi_bar((tau - 1) / sigma), capped at 1."""
    k = _check_k(max_words_per_unit)
    sigma = _check_positive("noise_multiplier", noise_multiplier)
    return float(min(1.0, k * norm.sf((float(threshold) - 1.0) / sigma)))


def tokenizer_event(noise_multiplier: float, max_words_per_unit: int) -> dp_accounting.DpEvent:
    """The ledger event of one private-tokenizer release: `GaussianDpEvent(sigma/sqrt(K))`.

    Its threshold's delta (`threshold_delta`) is NOT in the event: store
    `ledger_extra(...)` in the same ledger record and account with
    `accountant.epsilon_with_threshold`.
    """
    k = _check_k(max_words_per_unit)
    sigma = _check_positive("noise_multiplier", noise_multiplier)
    return dp_accounting.GaussianDpEvent(sigma / math.sqrt(k))


def ledger_extra(
    noise_multiplier: float, threshold: float, max_words_per_unit: int, **more
) -> dict:
    """The ``extra`` of the ledger record of `tokenizer_event` (JSON-able)."""
    return {
        "mechanism": "private-tokenizer/gaussian-partition-selection",
        "noise_std": float(noise_multiplier),
        "threshold": float(threshold),
        "max_words_per_unit": int(max_words_per_unit),
        "delta_threshold": threshold_delta(noise_multiplier, threshold, max_words_per_unit),
        **more,
    }


def calibrate_tokenizer_noise(
    target_epsilon: float,
    target_delta: float,
    max_words_per_unit: int,
    *,
    delta_threshold_fraction: float = DEFAULT_DELTA_THRESHOLD_FRACTION,
    accountant: Accountant = Accountant.PLD,
    rel_tol: float = 1e-4,
) -> tuple[float, float, dict]:
    """(sigma, tau, details) making one release (target_epsilon, target_delta)-DP.

    delta_threshold = f * delta (f = `delta_threshold_fraction`, default 1/2), delta_gauss
    the rest. z = the smallest noise multiplier (to `rel_tol`, by `calibrate_sigma`) with
    eps(GaussianDpEvent(z), delta_gauss) <= target_epsilon + log(1 - delta_threshold)
    (dp-accounting via `llmdp.privacy.accounting.accountant`), sigma = z * sqrt(K),
    tau = 1 + sigma * Phi_bar^{-1}(delta_threshold / K).
    """
    k = _check_k(max_words_per_unit)
    eps_t = _check_positive("target_epsilon", target_epsilon)
    delta = float(target_delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"target_delta must be in (0, 1), got {target_delta!r}")
    f = float(delta_threshold_fraction)
    if not (0.0 < f < 1.0):
        raise ValueError(f"delta_threshold_fraction must be in (0, 1), got {f!r}")
    d_thr = f * delta
    d_gauss = delta - d_thr
    eps_g = eps_t + math.log1p(-d_thr)

    def eps_of(z: float) -> float:
        return epsilon([(dp_accounting.GaussianDpEvent(z), 1)], d_gauss, accountant)

    # Bracket [lo, hi] with eps(lo) > target >= eps(hi), doubling / halving from z = 1
    # (tiny z are never evaluated: PLD of a very small multiplier is huge and slow).
    lo, hi = 0.5, 1.0
    if eps_of(hi) > eps_g:
        while eps_of(hi) > eps_g:
            lo, hi = hi, hi * 2.0
            if hi > 1e6:
                raise ValueError(
                    f"no noise multiplier <= 1e6 reaches epsilon={eps_t} at delta={delta}"
                )
    else:
        while eps_of(lo) <= eps_g:
            lo, hi = lo / 2.0, lo
            if lo < 0.05:
                raise ValueError(
                    f"target_epsilon={eps_t} is too large to calibrate (noise multiplier "
                    "< 0.05 per count); use a smaller epsilon"
                )
    # The root in [lo, hi] by the planner's σ search (Brent's method on log z, to
    # `rel_tol`, then checked: eps(z) <= target): ~6 evaluations where a bisection took 14.
    z = calibrate_sigma(eps_of, eps_g, start=hi, factor=hi / lo, rtol=rel_tol, log=True)
    sigma = z * math.sqrt(k)
    tau = 1.0 + sigma * float(norm.isf(d_thr / k))
    details = {
        "noise_multiplier_gaussian": z,
        "delta_gauss": d_gauss,
        "delta_threshold": d_thr,
        "epsilon_gauss": eps_of(z),
        "epsilon": eps_of(z) - math.log1p(-d_thr),
        "target_epsilon": eps_t,
        "target_delta": delta,
        "max_words_per_unit": k,
        "accountant": accountant,
    }
    return sigma, tau, details


# ----------------------------------------------------------------------------- training


def _write_tsv(counts: Mapping[str, int], path: str) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for w in sorted(counts):
            c = counts[w]
            if isinstance(c, bool) or int(c) != c or c < 1:
                raise ValueError(f"counts must be integers >= 1, got counts[{w!r}]={c!r}")
            if "\t" in w or "\n" in w or "\r" in w or not w:
                continue  # cannot be a whitespace-split word anyway
            f.write(f"{w}\t{int(c)}\n")
            n += 1
    return n


def train_sentencepiece_from_counts(
    counts: Mapping[str, int],
    *,
    vocab_size: int,
    out_dir,
    model_type: str = "unigram",
    byte_fallback: bool = True,
    character_coverage: float = 1.0,
    extra_meta: Mapping | None = None,
) -> str:
    """Train SentencePiece on a {word: count} table and write an HF tokenizer folder.

    Uses sentencepiece's word-frequency input (``input_format="tsv"``), so the model sees
    nothing but `counts` (released DP counts: post-processing). Special tokens
    ``<s>`` ``</s>`` ``<pad>`` ``<unk>`` are ids 0-3; no BOS/EOS is added on encode (like
    `llmdp.tokenizer.public`). With ``byte_fallback`` every byte is a piece, so any text
    encodes without ``<unk>`` (vocab_size must then leave room: > 4 + 256 + chars).
    ``vocab_size`` is a soft limit (``hard_vocab_limit=False``): when few words were
    released, SentencePiece makes a smaller vocabulary instead of failing.

    The folder holds ``spm.model`` and a ``tokenizer.json`` built from it (`_hf_tokenizer`)
    that ``AutoTokenizer.from_pretrained(out_dir)`` loads offline, giving the SentencePiece
    model's ids (special tokens in the text are matched as HF added tokens, whereas
    SentencePiece never matches control pieces in text). Written atomically; returns the
    path.
    """
    import sentencepiece as spm

    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"model_type must be 'unigram' or 'bpe', got {model_type!r}")
    if not counts:
        raise ValueError("counts is empty: nothing was released (lower tau / raise epsilon?)")

    out_dir = os.path.abspath(os.fspath(out_dir))
    with building_dir(out_dir, ".tmp-private-tokenizer-") as tmp:
        work = tempfile.mkdtemp(prefix="spm-", dir=tmp)
        tsv = os.path.join(work, "counts.tsv")
        n_words = _write_tsv(counts, tsv)
        prefix = os.path.join(work, "spm")
        spm.SentencePieceTrainer.train(
            input=tsv,
            input_format="tsv",
            model_prefix=prefix,
            vocab_size=int(vocab_size),
            model_type=model_type,
            byte_fallback=bool(byte_fallback),
            character_coverage=float(character_coverage),
            bos_id=0, eos_id=1, pad_id=2, unk_id=3,
            bos_piece=SPECIAL_TOKENS[0], eos_piece=SPECIAL_TOKENS[1],
            pad_piece=SPECIAL_TOKENS[2], unk_piece=SPECIAL_TOKENS[3],
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=True,
            hard_vocab_limit=False,  # few released words: a smaller vocabulary, not an error
            num_threads=1,
            minloglevel=2,
        )
        shutil.copyfile(prefix + ".model", os.path.join(tmp, "spm.model"))
        shutil.rmtree(work)
        fast = _hf_tokenizer(os.path.join(tmp, "spm.model"))
        fast.save_pretrained(tmp)
        _make_portable(tmp, fast)
        with open(os.path.join(tmp, "llmdp_tokenizer.json"), "w") as f:
            json.dump(
                {"kind": "private-sentencepiece", "model_type": model_type,
                 "vocab_size": int(vocab_size), "released_words": n_words,
                 **dict(extra_meta or {})},
                f, indent=2, sort_keys=True,
            )
            f.write("\n")
        replace_dir(tmp, out_dir)
    return out_dir


def _hf_tokenizer(model_file: str):
    """A `PreTrainedTokenizerFast` equivalent to the SentencePiece model (built directly
    from its proto, not through transformers' version-dependent slow->fast converters).

    SentencePiece here uses identity normalization, no whitespace removal and a dummy
    prefix, so the equivalent pipeline is: normalizer Prepend("▁") + Replace(" ",
    "▁"); no pre-tokenizer; Unigram(vocab, scores) or BPE(vocab, merges ranked by the
    merged piece's id, which is SentencePiece BPE's score order); byte fallback; decoder
    Replace("▁", " ") + ByteFallback + Fuse + Strip(one leading space).
    """
    from sentencepiece import sentencepiece_model_pb2 as pb
    from transformers import PreTrainedTokenizerFast

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    proto = pb.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    spec = proto.trainer_spec
    pieces = [(p.piece, float(p.score)) for p in proto.pieces]
    if spec.model_type == pb.TrainerSpec.UNIGRAM:
        model = models.Unigram(pieces, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    elif spec.model_type == pb.TrainerSpec.BPE:
        vocab = {p: i for i, (p, _) in enumerate(pieces)}
        normal = {
            p.piece for p in proto.pieces if p.type == pb.ModelProto.SentencePiece.NORMAL
        }
        merges = []
        for piece in normal:
            for j in range(1, len(piece)):
                a, b = piece[:j], piece[j:]
                if a in normal and b in normal:
                    merges.append((vocab[piece], vocab[a], vocab[b], a, b))
        merges.sort()
        model = models.BPE(
            vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=spec.unk_piece,
            fuse_unk=True, byte_fallback=spec.byte_fallback, dropout=None,
        )
    else:  # pragma: no cover - train_sentencepiece_from_counts only makes the two
        raise ValueError(f"unsupported SentencePiece model_type {spec.model_type}")
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(content=" ", left=1)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[2], unk_token=SPECIAL_TOKENS[3],
        clean_up_tokenization_spaces=False,
    )
