"""`llmdp audit` end to end on Ray (issue 19): the broken-mechanism self-test flags a
violation; the real mechanism's audit stays below its ε, records its releases in the
dataset ledger, and nothing of the canaries or the key reaches an export."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from llmdp.audit import canaries as cn
from llmdp.cli import main
from tests.helpers import dataset_records, tiny_tokenizer, tiny_tokenizer_dir, write_notes

# slow, and in process on the test process's one Ray (conftest.shared_ray)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

# A tiny model on a tiny corpus (~220 sequence units) and a high sampling rate: each
# included canary is sampled ~3 times in 40 steps. σ = 10 claims a small ε (~0.15), which
# the noise-free (planted) mechanism must be caught exceeding.
RECIPE = """
model:
  init: tiny
  tokenizer: {tok}
  tiny: {{hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, intermediate_size: 64,
         max_position_embeddings: 64}}
data: {{path: notes.jsonl, sequence_length: 32}}
privacy: {{noise_multiplier: 10.0, max_grad_norm: 1.0, delta: 1.0e-5}}
optim: {{name: adamw, lr: 0.01, schedule: constant}}
train: {{expected_batch_size: 32, steps: {steps}, physical_batch_size: 128, checkpoint_every: 100}}
scaling: {{num_workers: 1}}
output: {{dir: runs, name: a}}
"""


def _setup(tmp_path, monkeypatch, steps):
    monkeypatch.chdir(tmp_path)
    write_notes(tmp_path / "notes.jsonl", 10)
    (tmp_path / "r.yaml").write_text(RECIPE.format(tok=tiny_tokenizer_dir(), steps=steps))


def test_the_auditor_flags_a_mechanism_without_noise(tmp_path, monkeypatch, capsys):
    """Issue 19 item 4: the same audit with the noise switched off by the test-only plant
    reports an empirical lower bound above the ε the run claims, at 95% confidence, and
    exits 3; the run says it was planted and cannot be exported."""
    _setup(tmp_path, monkeypatch, steps=40)
    monkeypatch.setenv("LLMDP_TEST_PLANT", "noise-off")
    assert main(["audit", "r.yaml", "--canaries", "400", "--record-fraction", "0.2"]) == 3
    out = capsys.readouterr().out
    assert "VIOLATION" in out
    run_dir = tmp_path / "runs" / "a-audit"
    r = json.loads((run_dir / "audit.json").read_text())
    assert r["planted"] == "noise-off" and r["violation"] and r["confidence"] == 0.95
    assert r["empirical_epsilon_lower_bound"] > r["epsilon_training"] > 0
    assert r["epsilon_training"] < 0.35  # what σ = 10 claims at the recipe's q (kept by the audit)
    report = (run_dir / "privacy_report.md").read_text()
    assert report.startswith("**Warning: a planted bug (noise-off")
    assert "## Empirical audit" in report
    monkeypatch.delenv("LLMDP_TEST_PLANT")
    assert main(["export", str(run_dir), "--to", str(tmp_path / "exp"), "--allow-unverified"]) == 2
    assert "planted bug" in capsys.readouterr().err


def test_an_audit_of_the_real_mechanism_is_recorded_and_never_exported(tmp_path, monkeypatch, capsys):
    """Unbroken: the bound is at most the guarantee's ε; the audit run's releases are in
    the private data's ledger; its export carries the Empirical audit section and nothing
    of the canaries, their coins or the key."""
    _setup(tmp_path, monkeypatch, steps=20)
    assert main(["audit", "r.yaml", "--canaries", "200"]) == 0
    run_dir = tmp_path / "runs" / "a-audit"
    r = json.loads((run_dir / "audit.json").read_text())
    assert r["planted"] is None and not r["violation"]
    assert 0 <= r["empirical_epsilon_lower_bound"] <= r["epsilon_training"]
    assert r["canaries"] == 200 and set(r["scores"]) == {"black-box", "white-box"}
    # the f-DP bound and its ceiling beside it (issue 35 items 3 and 4)
    assert r["f_dp_epsilon"] >= 0 and r["f_dp_mu_lower_bound"] >= 0
    # (a 20-step run at small ε: the ideal audit of 200 canaries may find nothing either)
    assert r["ceiling"]["epsilon"] >= 0 and r["ceiling"]["canaries"] == 200
    assert r["ceiling"]["steps"] == 20 and r["ceiling"]["mu"] is not None
    plan = json.loads((run_dir / "plan.json").read_text())
    key = cn.read_key(str(run_dir / "audit" / "key"))
    c = cn.load_canaries(str(run_dir / "audit" / "canaries.jsonl"))
    assert np.array_equal(c.included, cn.coins(key, 200))
    assert plan["data"]["audit_canaries_included"] == int(c.included.sum())

    # the audit run's DP releases are in the dataset ledger of the private data
    recs = dataset_records(None, data_path=tmp_path / "notes.jsonl")
    mine = [x for x in recs if x.get("kind") == "release" and x.get("run_id") == plan["run_id"]]
    assert sum(x["count"] for x in mine) >= 20

    capsys.readouterr()
    assert main(["export", str(run_dir), "--to", str(tmp_path / "exp")]) == 0
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "exp") for f in fs]
    rel = [os.path.relpath(f, tmp_path / "exp") for f in files]
    assert not [f for f in rel if "audit" in f.split(os.sep)[:-1] or f.startswith("audit.")], rel
    blob = b"".join(open(f, "rb").read() for f in files)
    assert key.hex().encode() not in blob
    tok = tiny_tokenizer()
    texts = [tok.decode(row.tolist()) for row in c.rows]
    leaked = [t for t in texts if len(t) >= 16 and t.encode() in blob]
    assert not leaked, leaked[:2]
    for name in ("canaries.jsonl", "scores.npz", "key", "store-all", "store-train"):
        assert not any(name in f for f in files), name
    card = (tmp_path / "exp" / "README.md").read_text()
    assert "## Empirical audit" in card
    published = json.loads((tmp_path / "exp" / "privacy_report.json").read_text())
    assert published["empirical_audit"]["empirical_epsilon_lower_bound"] == r["empirical_epsilon_lower_bound"]


def test_a_gradient_canary_audit_scores_every_iterate_as_the_ideal_model_says(tmp_path, monkeypatch):
    """Issue 35 items 1, 2 and 4: gradient canaries through the real engine and strategy,
    projected on every noisy update (20 steps). The recorded projections follow the model the ceiling
    simulates (x = b + σz, b = 1 when sampled): an excluded canary's have mean 0 and standard
    deviation σ, an included canary's mean q (each within 5 standard errors): a canary clipped
    to less than C, or noise of another scale, fails it. The (ε, δ) bound stays below the
    guarantee; the projections are secret (audit/, 0600), one record per step."""
    from llmdp.audit import gradient as gc

    _setup(tmp_path, monkeypatch, steps=20)
    y = (tmp_path / "r.yaml").read_text().replace("noise_multiplier: 10.0", "noise_multiplier: 1.0")
    (tmp_path / "r.yaml").write_text(y)
    assert main(["audit", "r.yaml", "--canaries", "400", "--canary-kind", "gradient"]) == 0
    run_dir = tmp_path / "runs" / "a-audit"
    r = json.loads((run_dir / "audit.json").read_text())
    assert r["canary_kind"] == "gradient" and set(r["scores"]) == {"gradient"}
    assert not r["violation"] and 0 <= r["empirical_epsilon_lower_bound"] <= r["epsilon_training"]
    assert r["ceiling"]["epsilon"] > 0 and r["f_dp_epsilon"] >= 0
    secret = run_dir / "audit"
    assert oct(os.stat(secret / "iterates.bin").st_mode & 0o777) == "0o600"
    assert (secret / "iterates.bin").stat().st_size == 20 * (400 + 1) * 8  # one record a step
    report = json.loads((run_dir / "privacy_report.json").read_text())
    q, sigma = report["sampling_probability"], report["noise_multiplier"]
    inc = cn.load_canaries(str(secret / "canaries.jsonl")).included
    x = gc.read_iterates(str(secret), 400, 20)
    out, inn = x[:, ~inc].ravel(), x[:, inc].ravel()
    assert abs(out.mean()) < 5 * sigma / np.sqrt(out.size)
    assert abs(out.std() - sigma) < 5 * sigma / np.sqrt(2 * out.size)
    assert abs(inn.mean() - q) < 5 * np.sqrt((sigma**2 + q) / inn.size)


def test_a_gradient_canary_audit_flags_a_mechanism_that_does_not_clip(tmp_path, monkeypatch):
    """Issue 35 item 5: with clipping switched off by the test-only plant, a gradient canary
    adds its whole gradient (100·C) at every step it is sampled: the audit reports a bound
    above the claimed ε (σ = 10) and exits 3. (What the one-run audit cannot see: clip-scale
    (1.01·C) and bf16-sum (a relative 2⁻⁸ on the sum) change a canary's signal by about 1 %, far
    below the spread of one run's scores; fixed-batches changes how often a canary is sampled,
    not what one sampling adds, and is caught by the neighbour replay, not by canaries.)"""
    _setup(tmp_path, monkeypatch, steps=20)
    monkeypatch.setenv("LLMDP_TEST_PLANT", "clip-off")
    assert main(["audit", "r.yaml", "--canaries", "200", "--canary-kind", "gradient"]) == 3
    r = json.loads((tmp_path / "runs" / "a-audit" / "audit.json").read_text())
    assert r["planted"] == "clip-off" and r["violation"]
    assert r["empirical_epsilon_lower_bound"] > r["epsilon_training"] > 0
