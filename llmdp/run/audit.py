"""``llmdp audit RECIPE [key=value ...]``: an empirical lower bound on ε from one run
(issue 19, items 1–3).

The audit run is the recipe itself (same model, data, plan rules, steps, workers) in a run
directory of its own, ``<output.name>-audit``, trained on the private units plus the
canaries whose secret keyed coin came up heads (``llmdp.audit.canaries``). Its DP
releases go into the dataset's ledger like any run's: it trains on the private data. Its
expected batch is scaled with the expected number of included canaries
(``_keep_sampling_rate``: m/2, never the realized number, which is secret), so that q, σ and
ε are the recipe's in expectation: the audit measures the mechanism the recipe runs.

After training, each canary is scored against the final model (``llmdp.run.auditscores``:
black-box loss reduction, white-box gradient probe) and the one-run bound of Steinke,
Nasr and Jagielski (2023) turns the guesses on the most confident canaries into an ε
lower bound at the stated confidence (``llmdp.audit.estimate``). With both scores each is
tested at β/2 (a union bound), so the larger of the two is a valid bound at 1 − β.

Files. Publishable (``audit.json``, ``audit.md``, and the "Empirical audit" section of the
privacy report and of an export's model card): aggregate numbers only; on disk they are
owner-only like the rest of the audit run's folder (published through an export). Secret, in
``audit/`` (never published, never exported): the key (0600), the canaries with their
coins, the canary stores, the per-canary scores. The same command again resumes an
interrupted audit run with the same key, or re-scores a finished one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from llmdp.audit import canaries as cn
from llmdp.audit.section import audit_line, render_audit

SCORES = ("both", "black-box", "white-box")
CANARY_KINDS = ("input", "gradient")
AUDIT_VERSION = 1
METHOD = ("one-run audit (Steinke, Nasr and Jagielski, NeurIPS 2023), and its f-DP form for the "
          "Gaussian curves (Mahloujifar, Melis and Chaudhuri, ICML 2025): guesses on the most "
          "and least confident canaries, abstaining on the rest; a union bound over the "
          "abstention settings, the scores and the two estimators")
#: A gradient canary's row: the shortest a row can be (one input and one target token).
GRADIENT_ROW_TOKENS = 2
#: Canaries and draws of the ceiling's simulation (``fdp.ceiling``), and its seed.
CEILING_DRAWS, CEILING_SEED = 5, 0

__all__ = ["AuditSettings", "audit_run_dir", "run_audit", "summarize"]


@dataclass(frozen=True)
class AuditSettings:
    """What ``llmdp audit`` adds to the recipe (public)."""

    canaries: int = 1000
    record_fraction: float = 0.5  # the rest are random-token canaries
    scores: str = "both"
    confidence: float = 0.95  # the bound holds with this probability (1 − β)
    # input: token canaries scored on the final model (black-box, white-box); gradient: units
    # whose gradient is a secret direction, scored on every iterate (llmdp.audit.gradient)
    canary_kind: str = "input"

    def __post_init__(self):
        if isinstance(self.canaries, bool) or not isinstance(self.canaries, int) or self.canaries < 2:
            raise ValueError(f"--canaries: {self.canaries!r} is not an integer >= 2; use a few "
                             "hundred to a few thousand")
        if not 0.0 <= float(self.record_fraction) <= 1.0:
            raise ValueError(f"--record-fraction: {self.record_fraction!r} is not in [0, 1]")
        if self.scores not in SCORES:
            raise ValueError(f"--scores: {self.scores!r} is not one of {list(SCORES)}")
        if not 0.5 <= float(self.confidence) < 1.0:
            raise ValueError(f"--confidence: {self.confidence!r} is not in [0.5, 1); e.g. 0.95")
        if self.canary_kind not in CANARY_KINDS:
            raise ValueError(f"--canary-kind: {self.canary_kind!r} is not one of {list(CANARY_KINDS)}")


def audit_config(cfg):
    """The audit run's recipe: the recipe, in ``<output.name>-audit``, never pushed."""
    return dataclasses.replace(cfg, output=dataclasses.replace(
        cfg.output, name=f"{cfg.output.name}-audit", push_to=None))


def audit_run_dir(cfg) -> str:
    return os.path.abspath(audit_config(cfg).run_dir)


def _secret_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "audit")


def _prepare_canaries(cfg, settings: AuditSettings, run_dir: str, log) -> cn.Canaries:
    """The audit's key and canaries: made once (OS entropy), reused by a re-launch."""
    from llmdp.config.schema import ConfigError
    from llmdp.train.models import load_tokenizer

    secret = _secret_dir(run_dir)
    os.makedirs(secret, exist_ok=True)  # the run folder too: owner-only (`run_audit`)
    os.chmod(secret, 0o700)
    key_path, can_path = os.path.join(secret, "key"), os.path.join(secret, "canaries.jsonl")
    set_path = os.path.join(secret, "settings.json")
    want = {"canaries": settings.canaries, "record_fraction": settings.record_fraction,
            "sequence_length": cfg.data.sequence_length}
    if settings.canary_kind != "input":  # (older audits have no such key: input canaries)
        want["canary_kind"] = settings.canary_kind
    if os.path.exists(set_path):
        with open(set_path, encoding="utf-8") as f:
            had = json.load(f)
        if had != want:
            raise ConfigError(
                f"{run_dir} holds an audit with {had}, not {want}: give this audit its own "
                f"output.name, or delete that directory", key="output.name")
        log(f"audit: resuming with the key in {key_path}")
        return cn.load_canaries(can_path)
    tok = load_tokenizer(cfg.model.tokenizer or cfg.model.name_or_path)
    key = cn.new_key()
    # gradient canaries: one kind of row (its tokens are never scored: the probe replaces
    # its loss), so the per-kind standardization of the scores is one monotone map; and
    # rows of GRADIENT_ROW_TOKENS tokens (what they hold does not matter, so they cost next
    # to no compute: length bucketing packs them into micro-batches of their own width)
    gradient = settings.canary_kind == "gradient"
    fraction = 0.0 if gradient else settings.record_fraction
    length = GRADIENT_ROW_TOKENS if gradient else cfg.data.sequence_length
    canaries = cn.make_canaries(key, settings.canaries, tok, length, fraction)
    cn.write_key(key_path, key)
    cn.write_canaries(can_path, canaries)
    with open(set_path, "w", encoding="utf-8") as f:  # last: its presence means "made"
        json.dump(want, f)
    return canaries


def _keep_sampling_rate(acfg, canaries: cn.Canaries, log):
    """The audit run's recipe with its expected batch scaled from B to round(B·(N + m/2)/N),
    N the recipe's units, m the canaries: m/2 is the expected number included (each by a fair
    keyed coin), so the Poisson rate q = B/(N + included) is the recipe's B/N when as many
    are included as expected, and near it otherwise, and the audit measures the mechanism the
    recipe runs, not a diluted one. The realized number included is secret (it depends on
    the key, and the one-run analysis assumes it hidden): neither B nor the log depends on
    it. N comes from a plan of the recipe alone (its unit store is cached: the run's own
    plan reuses it)."""
    from llmdp.run.planning import plan_run

    n = plan_run(acfg, log=lambda *_: None).store.num_units
    b = int(acfg.train.expected_batch_size)
    expected = canaries.m / 2
    scaled = int(round(b * (n + expected) / n))
    log(f"audit: expected batch {b} -> {scaled} units, so that q = B/N is the recipe's "
        f"{b / n:.6g} in expectation over the canaries' coins (N = {n} + the included "
        f"canaries, {expected:g} expected)")
    return dataclasses.replace(acfg, train=dataclasses.replace(acfg.train, expected_batch_size=scaled))


def run_audit(cfg, settings: AuditSettings = AuditSettings(), log=print) -> dict:
    """Train the audit run, score the canaries, write ``audit.json`` / ``audit.md`` and the
    report's section; returns audit.json's content. Everything it writes (the audit run
    folder, its secrets, audit.json / audit.md) is owner-only (0700/0600; group-readable
    with ``output.group_readable``), like any run folder: it holds private data."""
    from llmdp._fs import private_files
    from llmdp.config.schema import ConfigError

    if not cfg.privacy.dp:
        raise ConfigError("privacy.dp: false: a NON-PRIVATE baseline has no ε to audit; audit "
                          "the DP recipe", key="privacy.dp")
    with private_files(cfg.output.group_readable):
        return _run_audit(cfg, settings, log)


def _run_audit(cfg, settings: AuditSettings, log) -> dict:
    from llmdp._fs import cache_root
    from llmdp.config.schema import ConfigError
    from llmdp.record.rundir import RunDir
    from llmdp.run import launch as trainer

    t0 = time.time()
    acfg = audit_config(cfg)
    run_dir = os.path.abspath(acfg.run_dir)
    canaries = _prepare_canaries(acfg, settings, run_dir, log)
    secret = _secret_dir(run_dir)
    log(f"audit: {canaries.m} canaries ({canaries.kinds.count('record')} synthetic records, "
        f"{canaries.kinds.count('random')} random-token), each included by a secret keyed coin; "
        f"run directory {run_dir}")

    gradient = settings.canary_kind == "gradient"
    if gradient and acfg.scaling.strategy != "replicated":
        raise ConfigError(f"scaling.strategy: {acfg.scaling.strategy!r}: gradient canaries are "
                          "projected on rank 0's replicated update; audit with "
                          "scaling.strategy=replicated", key="scaling.strategy")

    def augment(store, tokenizer):
        # The training store: the private units, then the included canaries (one shard);
        # and every canary alone, which the scores are computed on.
        tag = store.fingerprint[:16]
        if gradient:  # the workers' probes: the canary shard starts after the private units
            from llmdp.audit import gradient as gc

            gc.write_spec(secret, canaries.m, None, store.num_units,
                          np.flatnonzero(canaries.included))
        cn.augmented_store(store, canaries, os.path.join(secret, f"store-all-{tag}"), which="all")
        return cn.augmented_store(store, canaries, os.path.join(secret, f"store-train-{tag}"))

    acfg = _keep_sampling_rate(acfg, canaries, log)
    trainer.run(acfg, log=log, augment=augment)
    t_train = time.time() - t0
    rd = RunDir(run_dir)
    with open(os.path.join(run_dir, "privacy_report.json"), encoding="utf-8") as f:
        report = json.load(f)
    if report.get("status") != "complete":
        raise RuntimeError(f"the audit run {run_dir} did not complete (status "
                           f"{report.get('status')!r}); run the same command again to resume it")
    if gradient:
        from llmdp.audit import gradient as gc

        it = gc.read_iterates(secret, canaries.m, int(report["steps_completed"]))
        per = {"gradient": gc.scores(it, float(report["noise_multiplier"]),
                                     float(report["sampling_probability"]))}
        return _finish(per, canaries, report, settings, run_dir, secret, t0, t_train, log)
    all_dirs = sorted(d for d in os.listdir(secret) if d.startswith("store-all-"))
    if len(all_dirs) != 1:
        raise RuntimeError(f"{secret}: expected one canary store, found {all_dirs}")
    from llmdp.data.store import open_store
    from llmdp.run import auditscores as sc

    store = open_store(os.path.join(secret, all_dirs[0]))
    models = os.path.join(cache_root(), "models")
    initial = sc.initial_model(acfg, models)
    final = sc.final_model(acfg, models, rd.latest_checkpoint())
    kinds = ["black-box", "white-box"] if settings.scores == "both" else [settings.scores]
    per = {}
    for kind in kinds:
        s = sc.black_box_scores(initial, final, store) if kind == "black-box" else \
            sc.white_box_scores(initial, final, store)
        per[kind] = s
    return _finish(per, canaries, report, settings, run_dir, secret, t0, t_train, log)


def _finish(per, canaries, report, settings, run_dir, secret, t0, t_train, log) -> dict:
    from llmdp.base import plants as plant
    from llmdp.report.build import write_report

    np.savez(os.path.join(secret, "scores.npz"), included=canaries.included, **{
        k.replace("-", "_"): v for k, v in per.items()})
    t_score = time.time() - t0 - t_train
    result = summarize(per, canaries, report, settings, {"train": t_train, "score": t_score,
                                                         "total": time.time() - t0})
    result["planted"] = plant.active()
    result["canary_kind"] = settings.canary_kind
    with open(os.path.join(run_dir, "audit.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(run_dir, "audit.md"), "w", encoding="utf-8") as f:
        f.write(render_audit(result))
    write_report(run_dir)  # the report's "Empirical audit" section
    log(audit_line(result))
    return result


def by_kind(scores: np.ndarray, kinds) -> np.ndarray:
    """Scores standardized within each canary kind (minus the kind's median, over its
    median absolute deviation). Records and random tokens move by different amounts
    (records resemble the data): ranked together, the most confident guesses would all be
    of one kind, included or not. A function of the model and the canaries only (all of
    them, included or not), never of the coins, so the one-run bound still holds."""
    scores = np.asarray(scores, dtype=np.float64)
    kinds = np.asarray(kinds)
    out = np.empty_like(scores)
    for k in np.unique(kinds):
        sel = kinds == k
        s = scores[sel]
        med = float(np.median(s))
        mad = float(np.median(np.abs(s - med))) or 1.0
        out[sel] = (s - med) / mad
    return out


def summarize(per: dict, canaries: cn.Canaries, report: dict, settings: AuditSettings,
              times: dict, with_ceiling: bool = True) -> dict:
    """audit.json: the bounds and the attack's quality, aggregate numbers only
    (``with_ceiling=False``: without the ceiling's simulations, for repeated audits)."""
    from llmdp.audit import curve, estimate, fdp

    mech = _mechanism(report)  # (q, σ, T) of independent Poisson-Gaussian steps, or None
    beta = 1.0 - float(settings.confidence)
    # a union bound over the scores and the estimators (Steinke et al.; f-DP on the Gaussian
    # curves; f-DP on the mechanism's own curves, when it has them)
    beta_each = beta / ((3 if mech else 2) * len(per))
    delta = float(report["delta"])
    eps_claimed = float(report["epsilon"])
    # The run's training steps (a private tokenizer's earlier release and the DP
    # evaluations excluded: the canaries are training units, which neither reads).
    eps_train = float(report.get("epsilon_training_only") or eps_claimed)
    out_scores = {}
    for kind, raw in per.items():
        s = by_kind(raw, canaries.kinds)
        b = estimate.audit_bound(s, canaries.included, delta, beta=beta_each)
        out_scores[kind] = {
            **{k: (float(v) if isinstance(v, (float, np.floating)) else v)
               for k, v in dataclasses.asdict(b).items()},
            "tpr_at_fpr": {str(f): estimate.tpr_at_fpr(s, canaries.included, f) for f in (0.01, 0.1)},
            "f_dp": _floats(dataclasses.asdict(fdp.audit_gdp(s, canaries.included, delta, beta=beta_each))),
        }
        if mech:
            out_scores[kind]["f_dp_curve"] = _floats(dataclasses.asdict(
                curve.audit_curve(s, canaries.included, *mech, delta, beta=beta_each)))
    best = max(out_scores.values(), key=lambda b: b["epsilon_lower_bound"])
    lb = float(best["epsilon_lower_bound"])
    best_fdp = max((b["f_dp"] for b in out_scores.values()), key=lambda b: b["mu_lower_bound"])
    curves = [b["f_dp_curve"] for b in out_scores.values() if "f_dp_curve" in b]
    best_curve = max(curves, key=lambda b: b["epsilon"]) if curves else None
    return {
        "audit_version": AUDIT_VERSION,
        "method": METHOD,
        "confidence": float(settings.confidence),
        "canaries": canaries.m,
        "canary_kinds": {k: canaries.kinds.count(k) for k in cn.KINDS},
        # not the realized number included: it depends on the key (secret; `audit/` has the coins)
        "delta": delta,
        "epsilon_claimed": eps_claimed,
        "epsilon_training": eps_train,
        "empirical_epsilon_lower_bound": lb,
        "ratio_to_training_epsilon": lb / eps_train if eps_train > 0 else None,
        # Steinke et al.'s bound above ε, or the run's own curve (its σ) rejected
        "violation": lb > eps_train or any(b["rejects_claimed"] for b in curves),
        "f_dp_mu_lower_bound": best_fdp["mu_lower_bound"],
        "f_dp_epsilon": best_fdp["epsilon"],
        "f_dp_curve_epsilon": best_curve["epsilon"] if best_curve else None,
        "f_dp_curve_noise_multiplier": best_curve["noise_multiplier"] if best_curve else None,
        "ceiling": audit_ceiling(report, canaries.m, delta, beta_each) if with_ceiling else None,
        "scores": out_scores,
        "time_s": {k: round(float(v), 1) for k, v in times.items()},
        "settings": dataclasses.asdict(settings),
    }


def _floats(d: dict) -> dict:
    return {k: (float(v) if isinstance(v, (float, np.floating)) else v) for k, v in d.items()}


def _mechanism(report: dict):
    """(q, σ, T) when the run's steps are independent Poisson-subsampled Gaussian releases
    (DP-SGD), else None (a correlated mechanism's noise is not independent across steps)."""
    q, sigma = report.get("sampling_probability"), report.get("noise_multiplier")
    steps = int(report.get("steps_completed") or 0)
    if report.get("correlated_noise") or not q or not sigma or steps < 1:
        return None
    return float(q), float(sigma), steps


def audit_ceiling(report: dict, m: int, delta: float, beta: float) -> dict:
    """What the f-DP estimators reach on ideal scores of this run's own mechanism
    (``curve.ceiling`` and ``fdp.ceiling``: Poisson rate q, noise multiplier σ, the steps
    completed; m canaries, each setting at level β as in the audit), so that a bound reads
    against what is reachable rather than against ε alone. Only for independent Gaussian
    noise under Poisson sampling: a correlated mechanism's iterates are not that simulation
    (``None`` then, with the reason)."""
    from llmdp.audit import curve, fdp

    mech = _mechanism(report)
    if mech is None:
        why = ("a correlated mechanism: its noise is not independent across steps"
               if report.get("correlated_noise") else
               "no Poisson rate, noise multiplier or completed step in the report")
        return {"mu": None, "epsilon": None, "reason": why}
    q, sigma, steps = mech
    own = curve.ceiling(q, sigma, steps, m, delta, beta, draws=CEILING_DRAWS, seed=CEILING_SEED)
    gauss = fdp.ceiling(q, sigma, steps, m, delta, beta, draws=CEILING_DRAWS, seed=CEILING_SEED)
    return {"epsilon": own.epsilon, "noise_multiplier": own.noise_multiplier,
            "mu": gauss.mu_lower_bound, "gdp_epsilon": gauss.epsilon,
            "q": q, "sigma": sigma, "steps": steps, "canaries": m, "draws": CEILING_DRAWS,
            "seed": CEILING_SEED,
            "basis": "ideal gradient canaries, the likelihood ratio of every iterate's projection"}
