"""The realized number of included canaries is secret (issue 49): it depends on the audit's
key (each canary's keyed coin), and the one-run analysis assumes it hidden. Nothing
published holds it, and the audit run's planned batch does not depend on it."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np

from llmdp.audit import canaries as cn
from llmdp.audit.section import audit_section, render_audit
from llmdp.run.audit import AuditSettings, _keep_sampling_rate, summarize

M = 64


def _canaries(key: bytes) -> cn.Canaries:
    return cn.Canaries(rows=tuple(np.zeros(2, np.int32) for _ in range(M)),
                       kinds=("random",) * M, included=cn.coins(key, M))


def _two_keys() -> tuple[cn.Canaries, cn.Canaries]:
    """Canaries under two keys whose coins include different numbers of canaries."""
    first = _canaries(bytes(32))
    for i in range(1, 200):
        other = _canaries(bytes([i]) * 32)
        if int(other.included.sum()) != int(first.included.sum()):
            return first, other
    raise AssertionError("no two keys with different included counts among 200")


def test_the_published_audit_holds_no_realized_included_count(tmp_path):
    """audit.json (and so the report's section, the card's and audit.md) has no
    `canaries_included`, and an audit.json of an earlier llmdp that had one does not carry
    it into the report."""
    report = {"delta": 1e-5, "epsilon": 2.0, "epsilon_training_only": 2.0}
    rng = np.random.default_rng(0)
    for c in _two_keys():
        r = summarize({"black-box": rng.normal(size=M)}, c, report, AuditSettings(canaries=M),
                      {"total": 1.0}, with_ceiling=False)
        assert "canaries_included" not in r
        assert "canaries_included" not in json.dumps(r)
        r["canaries_included"] = int(c.included.sum())  # as an earlier llmdp wrote audit.json
        with open(os.path.join(tmp_path, "audit.json"), "w", encoding="utf-8") as f:
            json.dump(r, f)
        section = audit_section(str(tmp_path))
        assert "canaries_included" not in section
        assert "included canaries" not in render_audit(section)


def test_the_planned_batch_does_not_depend_on_the_coins(monkeypatch, tmp_path):
    """The audit's expected batch is scaled with the expected number of included canaries
    (m/2), a function of the settings, not of the key: two keys that include different
    numbers of canaries plan the same B and log the same lines."""
    import llmdp.run.planning as planning
    from tests.train.test_loop import make_recipe

    monkeypatch.setattr(planning, "plan_run",
                        lambda cfg, log=None: SimpleNamespace(store=SimpleNamespace(num_units=200)))
    cfg = make_recipe(tmp_path)
    out = []
    for c in _two_keys():
        lines: list[str] = []
        acfg = _keep_sampling_rate(cfg, c, lines.append)
        out.append((acfg.train.expected_batch_size, lines))
    assert out[0] == out[1]
    b = cfg.train.expected_batch_size
    assert out[0][0] == round(b * (200 + M / 2) / 200)
