"""A DP release of how close a synthetic corpus is to the private held-out split: MAUVE
from a noisy histogram (`llmdp synthetic quality ... --dp-epsilon E`; issue 55, item 3a).

`quality.py`'s MAUVE against the held-out rows reads private data without DP: internal. This
is the publishable version, one Gaussian release recorded in the dataset's ledger like a
step of training (write-ahead, within the dataset's budget), and everything after it
post-processing:

1. **Buckets from public inputs only.** The synthetic rows (post-processing of the DP model)
   are embedded by the run's starting model and quantized on their own
   (`mauve.fit_quantizer`: normalization, PCA, k-means): the buckets are a function of the
   corpus alone. P, the corpus' histogram over them, is public.
2. **The private statistic.** Each held-out unit's rows are embedded the same way and put in
   their buckets; the unit adds 1/r to the bucket of each of its r rows. Its vector v_u ≥ 0
   has ‖v_u‖₁ = 1, so ‖v_u‖₂ ≤ 1: adding or removing one unit moves the sum H = Σ_u v_u by
   at most Δ = 1 in L2 (Δ = √2 with ``data.eval.max_units``, where a unit may displace
   another: ‖v − v'‖₂² ≤ ‖v‖² + ‖v'‖² ≤ 2 for nonnegative v, v'). Which units are held out is
   each unit's own keyed hash (`llmdp.data.holdout`), so no other unit's membership moves.
3. **The release.** H̃ = H + N(0, (σΔ)²) per bucket, the noise from a fresh OS key, the
   event ``GaussianDpEvent(σ)`` (σ the noise multiplier, calibrated so that its ε at the
   run's δ is at most the requested one) appended to the dataset ledger *before* any noise
   exists (DESIGN, invariant `write-ahead-ledger`), refused when the dataset's budget
   cannot take it.
4. **Post-processing.** Q̃ = max(H̃, 0)/Σ max(H̃, 0) (uniform when nothing is left), MAUVE =
   the area under the divergence frontier of P and Q̃ (`mauve.frontier_area`). Written to
   ``FILE.quality.dp.json`` and the synthetic data card, with its own (ε, δ): the corpus'
   guarantee is the model's; this number spends more of the dataset's budget, which the
   ledger shows.

Only the held-out *split* of the training source is released this way (``data.eval.
fraction``): a separate evaluation source has a ledger of its own, and a public one is
better compared with ``--reference`` (free).
"""

from __future__ import annotations

import math
import os
import uuid

import numpy as np

from llmdp.synthetic.source import GenerateError

MECHANISM = "synthetic-quality-dp-mauve"


def sensitivity(cfg) -> float:
    """Δ of the held-out histogram (module docstring, 2)."""
    ev = cfg.data.eval
    return math.sqrt(2.0) if ev is not None and ev.max_units is not None else 1.0


def unit_histogram(labels: np.ndarray, unit_of_row: np.ndarray, num_units: int, k: int) -> np.ndarray:
    """H = Σ_u v_u: each unit's rows' buckets, each row weighing 1/(the unit's rows)."""
    rows = np.bincount(unit_of_row, minlength=num_units).astype(np.float64)
    w = 1.0 / rows[unit_of_row]
    return np.bincount(labels, weights=w, minlength=k).astype(np.float64)


def calibrate(target_epsilon: float, delta: float, accountant) -> tuple[float, float]:
    """(σ, ε): the smallest noise multiplier, to the planner's relative tolerance, whose one
    Gaussian release has ε ≤ ``target_epsilon`` at ``delta`` (dp-accounting), and that ε:
    the planner's one σ search (`llmdp.privacy.accounting.calibrate_sigma`: bracketed,
    Brent's method, then nudged up until the target holds)."""
    import dp_accounting

    from llmdp.privacy import accounting as acc

    def eps(s):
        return acc.epsilon([(dp_accounting.GaussianDpEvent(s), 1)], delta, accountant)

    def unreachable(_top):
        return GenerateError(f"--dp-epsilon {target_epsilon}: too small to calibrate at δ = {delta:g}")

    sigma = acc.calibrate_sigma(eps, target_epsilon, start=1.0, factor=2.0, max_sigma=1e6,
                                unreachable=unreachable)
    return sigma, eps(sigma)


#: Synthetic rows per bucket (the buckets' number is a function of the corpus alone): fewer,
#: fuller buckets than the internal score's (a tenth of the rows), so that the noise, the same
#: whatever the buckets, is small against each bucket's count.
ROWS_PER_BUCKET = 40


def release_mauve(*, cfg, source, synth_emb: np.ndarray, held_emb: np.ndarray,
                  unit_of_row: np.ndarray, num_units: int, target_epsilon: float, seed: int,
                  file: str, log=print, noise=None) -> dict:
    """Steps 1–4 of the module docstring; ``noise(k, std)`` draws the Gaussian vector
    (default: the keyed ChaCha20 sampler from a fresh OS key, `llmdp.privacy.noise.keyed_normal`).
    Also returns, under ``internal_noise_free``, the same score from the exact histogram: an
    internal number (it reads the held-out split without DP) for the data owner's judgement of
    what the noise moved; the caller keeps it out of the card."""
    import dp_accounting

    import llmdp.privacy.ledger as ledgers
    from llmdp.data.sources import source_fingerprint
    from llmdp.privacy import accounting as acc
    from llmdp.privacy.rng import secure_key
    from llmdp.run.planning import unit_spec
    from llmdp.synthetic.mauve import fit_quantizer, frontier_area

    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise GenerateError(f"--dp-epsilon {target_epsilon}: must be a finite number > 0")
    d, report = cfg.data, source.report
    if d.eval is None or d.eval.fraction is None:
        raise GenerateError(f"RUN_DIR {source.path}/config.yaml: data.eval is a separate source, "
                            f"not a held-out split of the training data; --dp-epsilon releases the "
                            f"split only (compare with a public source with --reference)")
    delta = report.get("delta")
    if not (isinstance(delta, float) and 0 < delta < 1):
        raise GenerateError(f"RUN_DIR {source.path}/privacy_report.json: delta is {delta!r}; give a "
                            f"finished DP run")
    sha = source_fingerprint(path=d.path, dataset=d.dataset, split=d.split,
                             config_name=d.config_name, format=d.format)
    quant = fit_quantizer(synth_emb, seed=seed,  # public: the synthetic rows alone
                          num_buckets=max(2, int(round(len(synth_emb) / ROWS_PER_BUCKET))))
    k = quant.num_buckets
    hp = np.bincount(quant.assign(synth_emb), minlength=k).astype(np.float64)
    hp /= hp.sum()
    h = unit_histogram(quant.assign(held_emb), unit_of_row, num_units, k)  # private
    accountant = report.get("accountant") or "pld"
    sigma, eps = calibrate(target_epsilon, delta, accountant)
    event = dp_accounting.GaussianDpEvent(sigma)
    delta_sens = sensitivity(cfg)
    spec = unit_spec(d)
    unit = {"unit": {**spec.to_dict(), "description": spec.describe()}}
    ledger = ledgers.open_dataset_ledger(d, cfg.privacy.ledger, sha, log=log)
    want = (report.get("dataset_ledger") or {}).get("dataset_id")
    if want is not None and ledger["dataset_id"] != want:
        raise GenerateError(
            f"RUN_DIR {source.path}: its data now opens the dataset ledger {ledger['dataset_id']!r}, "
            f"not the run's {want!r} (the data changed since the run); nothing was released")
    release_id = uuid.uuid4().hex[:12]
    run_id = f"synthetic-quality-{release_id}"
    meta = {"mechanism": MECHANISM, **unit, "dataset_fingerprint": sha,
            "dataset_size": num_units, "rng": "secure", "model_run_id": source.run_id,
            "file": os.path.basename(file), "buckets": k, "sensitivity": delta_sens}
    db = ledgers.LedgerDB(ledger["location"])
    try:
        with db.transaction(ledger["dataset_id"], full=True) as tx:
            _, why = ledgers.check_release(tx.records, unit, event, recipe=None,
                                           dataset_id=ledger["dataset_id"], where=ledger["shown"],
                                           what=f"this quality release (ε = {eps:.4f})")
            if why is not None:
                raise GenerateError(f"--dp-epsilon {target_epsilon}: {why}; nothing was released")
            rec = tx.append({"kind": "release", "event": acc.event_to_json(event), "count": 1,
                             "first_step": 0, "run_id": run_id, "attempt": "1", "meta": meta})
    finally:
        db.close()
    log(f"release {release_id} recorded in the dataset ledger {ledger['dataset_id']!r}: ε = {eps:.4f} "
        f"at δ = {delta:.3g} (σ = {sigma:.4f}, Δ = {delta_sens:g}, {k} buckets)")
    std = sigma * delta_sens
    if noise is None:
        from llmdp.privacy.noise import keyed_normal

        key = secure_key()
        z = np.array([keyed_normal(key, f"synthetic-quality/{i}".encode(), std) for i in range(k)])
        del key
    else:
        z = np.asarray(noise(k, std), dtype=np.float64)
    noisy = np.maximum(h + z, 0.0)
    hq = noisy / noisy.sum() if noisy.sum() > 0 else np.full(k, 1.0 / k)
    exact = frontier_area(hp, h / h.sum()) if h.sum() > 0 else None
    return {"label": "dp", "internal_noise_free": exact,
            "what": "MAUVE of the synthetic rows against the private held-out "
            "split, from a DP release of the held-out histogram over buckets fitted on the "
            "synthetic rows alone", "mauve": frontier_area(hp, hq),
            "epsilon": eps, "delta": delta, "accountant": str(accountant),
            "noise_multiplier": sigma, "sensitivity": delta_sens, "noise_std": std,
            "buckets": k, "held_out_units": num_units, "synthetic_rows": int(len(synth_emb)),
            "release_id": release_id, "run_id": run_id,
            "ledger": {"location": ledger["shown"], "dataset_id": ledger["dataset_id"],
                       "seq": rec["seq"], "hash": rec["hash"]},
            "adjacency": f"add-or-remove one {spec.describe()} of the held-out split"}
