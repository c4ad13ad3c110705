"""Canaries and their secret keyed coins (issue 19, item 1): fair, independent of the
data, reproducible with the key and only with it; each canary exactly one unit of the
augmented store; the planted-bug switch is never a recipe field."""

from __future__ import annotations

import math
import os
import stat

import numpy as np
import pytest

from llmdp.audit import canaries as cn
from llmdp.base import plants as plant
from tests.helpers import tiny_store, tiny_tokenizer

M = 4000
TOL = 5 * math.sqrt(0.25 / M)  # five standard deviations of a fair coin's mean over M


def test_coins_are_fair_and_reproducible_with_the_key_only():
    key = bytes(range(32))
    a = cn.coins(key, M)
    assert a.dtype == bool and a.shape == (M,)
    assert np.array_equal(a, cn.coins(key, M))  # the key reproduces them
    assert abs(a.mean() - 0.5) <= TOL
    # Another key: independent coins (agreement ~1/2, not 0 or 1)
    b = cn.coins(bytes(range(1, 33)), M)
    assert abs((a == b).mean() - 0.5) <= TOL
    # A prefix of the coins does not depend on how many there are
    assert np.array_equal(cn.coins(key, 100), a[:100])
    # Neighbouring coins are not correlated (the i-th and i+1-th agree half the time)
    assert abs((a[1:] == a[:-1]).mean() - 0.5) <= TOL
    with pytest.raises(ValueError, match="32 bytes"):
        cn.coins(b"short", 3)


def test_coins_do_not_depend_on_the_data_or_the_canaries():
    """Same key, different tokenizers, lengths and kinds of canaries: the same coins; and
    the coins are uncorrelated with what the canaries contain."""
    key = cn.new_key()
    tok = tiny_tokenizer()
    one = cn.make_canaries(key, 400, tok, 24, record_fraction=0.5)
    two = cn.make_canaries(key, 400, tok, 40, record_fraction=0.0)
    assert np.array_equal(one.included, two.included)
    assert np.array_equal(one.included, cn.coins(key, 400))
    parity = np.asarray([int(r[0]) % 2 for r in two.rows], dtype=bool)
    assert abs((parity == two.included).mean() - 0.5) <= 5 * math.sqrt(0.25 / 400)
    # the same key makes the same canaries; another key other canaries and coins
    again = cn.make_canaries(key, 400, tok, 24, record_fraction=0.5)
    assert all(np.array_equal(x, y) for x, y in zip(one.rows, again.rows))
    other = cn.make_canaries(cn.new_key(), 400, tok, 24, record_fraction=0.5)
    same = [np.array_equal(x, y) for x, y in zip(one.rows, other.rows)]
    # random canaries never coincide; record canaries cut at 24 tokens can share a note's
    # header ("DISCHARGE SUMMARY - ..."), a few of 200, never most of them
    assert sum(same[200:]) == 0
    assert sum(same[:200]) < 100
    assert not np.array_equal(one.included, other.included)


def test_canaries_have_the_kinds_and_lengths_asked_for():
    tok = tiny_tokenizer()
    c = cn.make_canaries(cn.new_key(), 50, tok, 32, record_fraction=0.4)
    assert c.kinds.count("record") == 20 and c.kinds.count("random") == 30
    special = {tok.eos_token_id, tok.pad_token_id} - {None}
    for row, kind in zip(c.rows, c.kinds):
        assert 2 <= len(row) <= 32
        if kind == "random":
            assert len(row) == 32 and not (set(row.tolist()) & special)
            assert row.max() < len(tok)
    # the record canaries are text from the faker generator, readable
    text = tok.decode(c.rows[0].tolist())
    assert sum(ch.isalpha() for ch in text) > len(text) / 3


def test_the_key_file_is_private_and_round_trips(tmp_path):
    key = cn.new_key()
    path = str(tmp_path / "key")
    cn.write_key(path, key)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert cn.read_key(path) == key
    c = cn.make_canaries(key, 30, tiny_tokenizer(), 24)
    cn.write_canaries(str(tmp_path / "c.jsonl"), c)
    back = cn.load_canaries(str(tmp_path / "c.jsonl"))
    assert back.kinds == c.kinds and np.array_equal(back.included, c.included)
    assert all(np.array_equal(x, y) for x, y in zip(back.rows, c.rows))
    assert stat.S_IMODE(os.stat(tmp_path / "c.jsonl").st_mode) == 0o600


def test_the_augmented_store_appends_each_included_canary_as_one_unit(tmp_path):
    private = tiny_store(tmp_path / "cache", num_documents=20, sequence_length=24)
    c = cn.make_canaries(cn.new_key(), 40, tiny_tokenizer(), 24, record_fraction=0.5)
    train = cn.augmented_store(private, c, str(tmp_path / "train"))
    every = cn.augmented_store(private, c, str(tmp_path / "all"), which="all")
    inc = np.flatnonzero(c.included)
    N = private.num_units
    assert train.num_units == N + inc.size and every.num_units == c.m
    # the private units are unchanged, in order
    for u in (0, N // 2, N - 1):
        a, b = private.rows([u]), train.rows([u])
        assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
    # each included canary: exactly one unit of one row, all tokens targets
    for j, i in enumerate(inc):
        batch = train.rows([N + j])
        assert batch["input_ids"].shape[0] == 1
        n = len(c.rows[i])
        assert np.array_equal(batch["input_ids"][0, :n].numpy(), c.rows[i])
        assert int(batch["num_target_tokens"][0]) == n - 1
    for i in range(c.m):
        assert np.array_equal(every.rows([i])["input_ids"][0, :len(c.rows[i])].numpy(), c.rows[i])
    assert train.fingerprint != private.fingerprint
    # opened again, not rebuilt
    assert cn.augmented_store(private, c, str(tmp_path / "train")).fingerprint == train.fingerprint


def test_the_plant_switch_is_the_environment_only(monkeypatch):
    """A planted bug is switched on by LLMDP_TEST_PLANT alone: no recipe field names it,
    and an unknown name is an error, not a silent no-op."""
    import dataclasses

    from llmdp.config import schema as config

    names = set()
    for cls in (config.RecipeConfig, config.PrivacyConfig, config.TrainConfig, config.ScalingConfig,
                config.DataConfig, config.ModelConfig, config.OptimConfig, config.OutputConfig):
        names |= {f.name for f in dataclasses.fields(cls)}
    assert not any("plant" in n for n in names)
    monkeypatch.delenv(plant.ENV, raising=False)
    assert plant.active() is None and not plant.on("noise-off")
    monkeypatch.setenv(plant.ENV, "noise-off")
    assert plant.on("noise-off") and not plant.on("clip-off")
    monkeypatch.setenv(plant.ENV, "noise-of")
    with pytest.raises(ValueError, match="noise-of"):
        plant.active()


def test_fixed_batches_plant_replaces_sampling(monkeypatch):
    from llmdp.privacy.sampling.poisson import PoissonSampler, make_sampler

    assert isinstance(make_sampler(100, 0.1), PoissonSampler)
    monkeypatch.setenv(plant.ENV, "fixed-batches")
    s = make_sampler(100, 0.1)
    batches = [s.sample(os.urandom(32)) for _ in range(10)]
    assert all(b.size == 10 for b in batches)
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(100))  # one pass: a partition
    assert np.array_equal(s.sample(os.urandom(32)), batches[0])  # then again, whatever the key


def test_bad_audit_arguments_get_one_clear_message(tmp_path, monkeypatch, capsys):
    from llmdp.cli import main
    from tests.helpers import tiny_tokenizer_dir, write_notes

    monkeypatch.chdir(tmp_path)
    write_notes(tmp_path / "notes.jsonl", 5)
    (tmp_path / "r.yaml").write_text(
        f"model: {{init: tiny, tokenizer: {tiny_tokenizer_dir()}}}\n"
        "data: {path: notes.jsonl, sequence_length: 16}\n"
        "privacy: {noise_multiplier: 1.0, max_grad_norm: 1.0, delta: 1.0e-5}\n"
        "optim: {name: sgd, lr: 0.1}\ntrain: {expected_batch_size: 4, steps: 2}\n")
    for argv, expected in (
            (["--canaries", "1"], "--canaries: 1 is not an integer >= 2"),
            (["--confidence", "1.5"], "--confidence: 1.5 is not in [0.5, 1)"),
            (["--record-fraction", "2"], "--record-fraction: 2.0 is not in [0, 1]"),
            (["privacy.dp=false"], "privacy.dp: false")):
        assert main(["audit", "r.yaml", *argv]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_unit_losses_are_each_units_normalized_loss(tmp_path):
    """The score's loss of unit u is the loss the run trains on: the sum of its rows'
    ``row_losses`` entries, computed on that unit alone."""
    import torch

    from llmdp.base.losses import row_losses
    from llmdp.run.auditscores import unit_losses
    from tests.helpers import TINY_VOCAB, tiny_llama

    store = tiny_store(tmp_path / "cache", num_documents=6, sequence_length=24)
    model = tiny_llama(vocab_size=TINY_VOCAB, dtype=torch.float64).eval()
    got = unit_losses(model, store, batch_units=5)
    assert got.shape == (store.num_units,)
    with torch.no_grad():
        want = [float(row_losses(model, store.rows([u])).sum()) for u in range(store.num_units)]
    np.testing.assert_allclose(got, want, rtol=1e-10)
