"""Private tokenizer: contribution bounding, Gaussian partition selection, calibration,
accounting (with the threshold's delta) and SentencePiece -> Hugging Face equivalence."""

import math
import os
import random

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant

from llmdp.privacy.accounting.accountant import epsilon, epsilon_with_threshold
from llmdp.privacy.accounting.accountant import threshold_delta as combined_threshold_delta
from llmdp.privacy.accounting.events import dpsgd_step_event, event_to_json
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.rng.keys import seeded_key
from llmdp.tokenizer.private import (
    SPECIAL_TOKENS,
    bound_unit_words,
    calibrate_tokenizer_noise,
    dp_word_counts,
    ledger_extra,
    pre_tokenize,
    threshold_delta,
    tokenizer_event,
    train_sentencepiece_from_counts,
    units_from_records,
    word_noise,
)

K = 16
DELTA = 1e-6
COMMON = [f"common{i}" for i in range(10)]  # every unit holds all of these


def _phi_bar(x: float) -> float:
    return 0.5 * math.erfc(x / math.sqrt(2.0))


@pytest.fixture(scope="module", params=[1.0, 4.0], ids=["eps1", "eps4"])
def calibrated(request):
    sigma, tau, details = calibrate_tokenizer_noise(request.param, DELTA, K)
    return request.param, sigma, tau, details


def _canary_units(num_units: int, run: int):
    """Units of <= K distinct words: the common words, a few shared words and one canary
    word that no other unit holds."""
    rng = random.Random(run)
    units = []
    for i in range(num_units):
        words = COMMON + [f"shared{rng.randrange(20)}" for _ in range(3)] + [f"canary{run}x{i}"]
        assert len(set(words)) <= K
        units.append(words * 3)  # repeats must count once
    return units


# ----------------------------------------------------------------------------- bounding


def test_bound_unit_words_at_most_k_distinct_and_independent_of_other_units():
    rng = random.Random(0)
    key = seeded_key(0, 0, "bound")
    vocab = [f"w{i}" for i in range(500)]
    for _ in range(200):
        words = [rng.choice(vocab) for _ in range(rng.randrange(1, 120))]
        got = bound_unit_words(words, K, key)
        assert len(got) == len(set(got)) == min(K, len(set(words)))
        assert set(got) <= set(words)
        # A function of the unit's own distinct words only (order, repeats irrelevant).
        shuffled = list(set(words))
        rng.shuffle(shuffled)
        assert bound_unit_words(shuffled, K, key) == got
    # The choice is keyed (not always the same K words).
    words = vocab[:100]
    picks = {tuple(sorted(bound_unit_words(words, K, seeded_key(0, s, "bound")))) for s in range(5)}
    assert len(picks) == 5


def test_dp_word_counts_each_unit_adds_at_most_k_words_once():
    rng = random.Random(1)
    vocab = [f"w{i}" for i in range(300)]
    units = [[rng.choice(vocab) for _ in range(rng.randrange(1, 200))] for _ in range(150)]
    key = seeded_key(0, 1, "bound")
    # Negligible noise and tau < 1: the release is the exact bounded count vector.
    got = dp_word_counts(units, max_words_per_unit=K, noise_multiplier=1e-9, threshold=0.5, key=key)
    expected = {}
    for u in units:
        for w in bound_unit_words(u, K, key):
            expected[w] = expected.get(w, 0) + 1
    assert got == expected
    assert sum(got.values()) <= K * len(units)
    assert all(c <= len(units) for c in got.values())
    # One unit repeating 1000 distinct words 5 times adds exactly K, each once.
    big = [f"z{i}" for i in range(1000)] * 5
    got2 = dp_word_counts(units + [big], max_words_per_unit=K, noise_multiplier=1e-9,
                          threshold=0.5, key=key)
    added = {w: c - got.get(w, 0) for w, c in got2.items() if c != got.get(w, 0)}
    assert sum(added.values()) == K and set(added.values()) == {1}


def test_word_noise_is_a_function_of_key_and_word_and_gaussian():
    key = seeded_key(0, 2, "noise")
    assert word_noise(key, "abc", 2.0) == word_noise(key, "abc", 2.0)
    assert word_noise(key, "abc", 2.0) != word_noise(seeded_key(0, 3, "noise"), "abc", 2.0)
    z = np.array([word_noise(key, f"w{i}", 3.0) for i in range(20000)])
    assert abs(z.mean()) < 5 * 3.0 / math.sqrt(len(z))
    assert abs(z.std() / 3.0 - 1.0) < 5 / math.sqrt(2 * len(z))
    # A word's noisy count does not depend on which other words exist.
    units = [["a", "b"], ["a", "c"], ["a"]]
    kw = dict(max_words_per_unit=K, noise_multiplier=0.3, threshold=-100.0, key=key)
    c1 = dp_word_counts(units, **kw)
    c2 = dp_word_counts(units + [[f"other{i}"] for i in range(50)], **kw)
    assert {w: c2[w] for w in c1} == c1


# ----------------------------------------------------------------------------- selection


def test_single_unit_words_are_not_released(calibrated):
    eps, sigma, tau, details = calibrated
    d_thr = details["delta_threshold"]
    passes = trials = 0
    for run in range(200):
        units = _canary_units(100, run)
        out = dp_word_counts(units, max_words_per_unit=K, noise_multiplier=sigma, threshold=tau,
                             key=seeded_key(1, run, "canary"))
        passes += sum(1 for w in out if w.startswith("canary"))
        trials += len(units)
    # Theory: P(a unit's canary passes) <= d_thr / K (~3e-8) per unit; 20000 trials.
    assert d_thr / K * trials < 1e-2
    assert passes == 0


def test_threshold_pass_rate_matches_theory():
    """Control for the test above: at a low threshold single-unit words do pass, at the
    rate Phi_bar((tau - 1) / sigma) that delta_threshold is built from."""
    sigma = 5.0
    for z in (0.0, 1.0, 2.0):
        tau = 1.0 + z * sigma
        passes = trials = 0
        for run in range(40):
            units = _canary_units(100, run)
            out = dp_word_counts(units, max_words_per_unit=K, noise_multiplier=sigma,
                                 threshold=tau, key=seeded_key(2, run, "rate"))
            passes += sum(1 for w in out if w.startswith("canary"))
            trials += len(units)
        p = _phi_bar(z)
        assert abs(passes / trials - p) < 5 * math.sqrt(p * (1 - p) / trials)
        assert threshold_delta(sigma, tau, K) == pytest.approx(min(1.0, K * p), rel=1e-9)


def test_frequent_words_are_kept(calibrated):
    eps, sigma, tau, _ = calibrated
    n = 300
    assert n > tau + 6 * sigma
    for run in range(20):
        out = dp_word_counts(_canary_units(n, run), max_words_per_unit=K, noise_multiplier=sigma,
                             threshold=tau, key=seeded_key(3, run, "frequent"))
        for w in COMMON:
            assert abs(out[w] - n) <= 6 * sigma + 1


# ----------------------------------------------------------------------------- accounting


def test_calibration_matches_dp_accounting(calibrated):
    eps, sigma, tau, d = calibrated
    z = d["noise_multiplier_gaussian"]
    assert sigma == pytest.approx(z * math.sqrt(K), rel=1e-12)
    assert d["delta_threshold"] + d["delta_gauss"] == pytest.approx(DELTA, rel=1e-12)

    def direct(zz):
        acc = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        return acc.compose(dp_accounting.GaussianDpEvent(zz)).get_epsilon(d["delta_gauss"])

    assert d["epsilon_gauss"] == pytest.approx(direct(z), rel=1e-9)
    assert direct(z) <= eps + math.log1p(-d["delta_threshold"])
    assert direct(z * (1 - 3e-4)) > eps + math.log1p(-d["delta_threshold"])  # smallest z
    # tau = 1 + sigma * Phi_bar^-1(delta_threshold / K)
    assert K * _phi_bar((tau - 1) / sigma) == pytest.approx(d["delta_threshold"], rel=1e-6)
    assert threshold_delta(sigma, tau, K) == pytest.approx(d["delta_threshold"], rel=1e-9)
    # The event of the release, accounted with its threshold, is within the target.
    entries = [(tokenizer_event(sigma, K), 1)]
    assert tokenizer_event(sigma, K) == dp_accounting.GaussianDpEvent(z)
    assert epsilon_with_threshold(entries, DELTA, d["delta_threshold"]) <= eps + 1e-9


def test_calibration_refuses_a_target_out_of_reach_either_way():
    """Below what z <= 1e6 reaches, and above what z >= 0.05 per count allows (RDP here:
    PLD at such a z is slow), one message each, naming the target."""
    with pytest.raises(ValueError, match=r"no noise multiplier <= 1e6 reaches epsilon=1e-07 "
                                         r"at delta=1e-06"):
        calibrate_tokenizer_noise(1e-7, DELTA, K)
    with pytest.raises(ValueError, match=r"target_epsilon=400.0 is too large to calibrate "
                                         r"\(noise multiplier < 0.05 per count\)"):
        calibrate_tokenizer_noise(400.0, DELTA, K, accountant="rdp")


def test_tokenizer_plus_dpsgd_composes_in_one_ledger(tmp_path, calibrated):
    eps, sigma, tau, d = calibrated
    q, noise, steps = 0.01, 1.1, 300
    db = LedgerDB(str(tmp_path / "ledger.sqlite"))
    db.append("d", {"kind": "release", "event": event_to_json(tokenizer_event(sigma, K)), "count": 1,
                    "run_id": "tok", "extra": ledger_extra(sigma, tau, K)})
    db.append("d", {"kind": "release", "event": event_to_json(dpsgd_step_event(q, noise)),
                    "count": steps, "run_id": "r"})
    from llmdp.privacy.ledger.budget import release_entries_of

    records = db.records("d")
    entries = release_entries_of(records)
    assert entries == [(dp_accounting.GaussianDpEvent(sigma / math.sqrt(K)), 1),
                       (dpsgd_step_event(q, noise), steps)]
    d_thr = combined_threshold_delta(records)
    assert d_thr == pytest.approx(d["delta_threshold"], rel=1e-9)

    composed = dp_accounting.ComposedDpEvent([
        dp_accounting.GaussianDpEvent(sigma / math.sqrt(K)),
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(noise)), steps),
    ])
    acc = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(composed)
    assert epsilon(entries, DELTA) == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
    want = acc.get_epsilon(DELTA - d_thr) - math.log1p(-d_thr)
    got = epsilon_with_threshold(entries, DELTA, d_thr)
    assert got == pytest.approx(want, rel=1e-9)
    assert got > epsilon(entries, DELTA)  # the threshold's delta is not free
    with pytest.raises(ValueError, match="delta_threshold"):
        epsilon_with_threshold(entries, 1e-7, d_thr)  # threshold alone exceeds the target


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def notes():
    from llmdp.data.synthetic import generate_clinical_notes

    return generate_clinical_notes(300, 0), generate_clinical_notes(40, 7)


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_trained_tokenizer_hf_equals_sentencepiece_and_round_trips(tmp_path, notes, model_type):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    train, held_out = notes
    sigma = 2.0  # fixed, for speed; tau at delta_threshold ~ 1e-6 for K = 64
    tau = 1.0 + sigma * 5.6
    counts = dp_word_counts(units_from_records(train), max_words_per_unit=64,
                            noise_multiplier=sigma, threshold=tau, key=seeded_key(4, 0, "train"))
    assert len(counts) > 50
    out = train_sentencepiece_from_counts(counts, vocab_size=600, model_type=model_type,
                                          out_dir=tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(out, "spm.model"))
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == sp.get_piece_size() > 300
    texts = [r["text"] for r in held_out] + [
        "Hello  world, \u00fcn\u00efcode \u65e5\u672c \U0001F600 x\ty", " leading", "a\nb  ", "",
        "Patient reports chest pain.",
    ]
    n_tokens = 0
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == sp.encode(text), text[:60]
        assert 3 not in ids  # byte fallback: never <unk>
        assert tok.decode(ids) == text
        n_tokens += len(ids)
    # It learned multi-character pieces from the released words (not only bytes/chars).
    assert n_tokens < 0.75 * sum(len(t.encode()) for t in texts)


def test_pre_tokenize_and_units_from_records():
    assert pre_tokenize(" a  b\tc\nd ") == ["a", "b", "c", "d"]
    assert pre_tokenize("x" * 100) == ["x" * 64]
    recs = [{"text": "a b", "u": 1}, {"text": "c", "u": 1}, {"text": "d", "u": 2}]
    assert units_from_records(recs) == [["a", "b"], ["c"], ["d"]]
    assert units_from_records(recs, unit_field="u") == [["a", "b", "c"], ["d"]]


def test_rejects_bad_arguments(tmp_path):
    key = seeded_key(0, 0, "bad")
    with pytest.raises(ValueError, match="max_words_per_unit"):
        dp_word_counts([["a"]], max_words_per_unit=0, noise_multiplier=1.0, threshold=1.0, key=key)
    with pytest.raises(ValueError, match="noise_multiplier"):
        dp_word_counts([["a"]], max_words_per_unit=1, noise_multiplier=0.0, threshold=1.0, key=key)
    with pytest.raises(TypeError):
        dp_word_counts(["a b"], max_words_per_unit=1, noise_multiplier=1.0, threshold=1.0, key=key)
    with pytest.raises(ValueError, match="empty"):
        train_sentencepiece_from_counts({}, vocab_size=300, out_dir=tmp_path / "t")
