"""`llmdp synthetic quality FILE RUN_DIR`: how useful a synthetic corpus is, measured against
the run's held-out split (issue 55, item 3). Every number is labelled by its inputs:

- ``internal``: it reads the private held-out (or training) units, or a NON-PRIVATE
  baseline's model, without DP. For the data owner's own judgement: written to
  ``FILE.quality.internal.json`` only, never to the synthetic data card;
- ``dp``: a DP release already made and accounted by the run (its DP evaluation of the
  held-out loss, copied from its privacy report);
- ``public``: computed from public inputs only: the corpus' own statistics (in the card
  already, `llmdp.synthetic.stats`), and, with ``--reference FILE``, MAUVE between the
  synthetic rows and a file the user declares public (checked like generate's prompts:
  not the recipe's private data, not data a ledger records; `llmdp.synthetic.inputs`), on
  the starting model's embeddings. Its inputs are the corpus (post-processing of the DP
  model), the public file and the starting model's weights, so it is post-processing too:
  written to ``FILE.quality.public.json`` and to the synthetic data card. The held-out
  split's MAUVE is internal: publishing a similarity to private data would need a DP
  release of it, which llmdp does not make (the public reference is the way to publish one).

What is measured, all on the units of the recipe's own tokenizer and packing (`data.unit`,
`data.sequence_length`: the synthetic file is cut into units exactly as the training data
was; its rows and the held-out rows are what is compared):

1. **MAUVE** (`llmdp.synthetic.mauve`) between the synthetic rows and the held-out rows,
   on embeddings of the run's public starting model (the last hidden state, mean-pooled
   over each row's tokens); with a NON-PRIVATE baseline, the same for its samples (the
   corpus' settings, as `llmdp synthetic check` samples it); and a reference: training
   rows against held-out rows (real against real: what the quantization gives two samples
   of one distribution);
2. **train on synthetic, test on real**: the starting model fine-tuned WITHOUT DP on the
   synthetic rows (AdamW, ``steps`` steps of ``batch_size`` units drawn with ``seed``, the
   run's normalized unit loss), its held-out loss next to the starting model's, the DP
   model's and, given a baseline, the NON-PRIVATE model's (and the same fine-tuning on the
   baseline's samples). All losses are computed here by one function
   (`llmdp.evaluation.metrics.evaluate`) on the same held-out units.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile

import numpy as np

from llmdp.synthetic.source import GenerateError

BANNER = ("INTERNAL: computed on the private held-out data (and a NON-PRIVATE baseline, when "
          "given) without DP; for the data owner's own judgement, never published with the "
          "corpus and never in its card")
LABELS = {"internal": "reads private data or a NON-PRIVATE model without DP: not publishable",
          "dp": "a DP release of the run, accounted in its ledger: publishable",
          "public": "computed from the synthetic corpus, a file declared public and the starting "
                    "model only: post-processing of the DP model, publishable (in the card)"}


def embed(model, store, max_rows: int, batch_rows: int = 32):
    """[R, hidden] float64: each row's last hidden state mean-pooled over its tokens, for the
    first ``max_rows`` rows of ``store`` (unit by unit)."""
    import torch

    out, units, rows = [], [], 0
    for u in range(store.num_units):
        if rows >= max_rows:
            break
        units.append(u)
        rows += int(store.unit_row_count[u])
    model.eval()
    with torch.no_grad():
        for s in range(0, len(units), batch_rows):
            batch = store.rows(units[s:s + batch_rows], width="auto")
            mask = batch["attention_mask"]
            h = model(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False,
                      output_hidden_states=True).hidden_states[-1].to(torch.float64)
            m = mask.to(torch.float64)[:, :, None]
            out.append((h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1))
    emb = torch.cat(out).numpy() if out else np.zeros((0, 1))
    return emb[:max_rows]


def held_out_loss(model, store, physical_batch_size: int) -> dict:
    import torch

    from llmdp.evaluation.metrics import evaluate

    metrics, _ = evaluate(model, store, torch.device("cpu"), 0, 1, physical_batch_size)
    return {k: metrics.get(k) for k in ("loss", "perplexity", "accuracy")}


def train_on(model, store, *, steps: int, lr: float, batch_size: int, seed: int) -> dict:
    """``model`` fine-tuned WITHOUT DP on ``store``'s units (in place): AdamW, a constant
    learning rate, ``batch_size`` units drawn uniformly (with ``seed``) per step, the mean
    of the units' normalized losses (`llmdp.base.losses.row_losses`)."""
    import torch

    from llmdp.base.losses import row_losses

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = np.random.default_rng(seed)
    model.train()
    losses = []
    for _ in range(steps):
        units = gen.choice(store.num_units, size=min(batch_size, store.num_units), replace=False)
        batch = store.rows(np.sort(units), width="auto")
        loss = row_losses(model, batch).sum() / len(units)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return {"steps": steps, "lr": lr, "batch_units": int(min(batch_size, store.num_units)),
            "seed": seed, "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "optimizer": "adamw", "dp": False}


def _recipe(source):
    from llmdp.config.schema import ConfigError, recipe_from_dict

    try:
        return recipe_from_dict(source.config)
    except (ConfigError, ValueError) as e:
        raise GenerateError(f"{source.path}/config.yaml: the run's recipe does not load ({e}); "
                            f"give a run folder written by this llmdp") from None


def _check_baseline(run_dir: str, cfg) -> str:
    from llmdp.record.rundir import RunDir

    rd = RunDir(run_dir)
    if not rd.exists() or not os.path.isdir(rd.file("model")):
        raise GenerateError(f"--baseline {run_dir}: not a finished run folder (plan.json and model/)")
    bcfg = rd.config()
    if (bcfg.get("privacy") or {}).get("dp") is not False:
        raise GenerateError(f"--baseline {run_dir}: privacy.dp is not false; the comparison is with "
                            f"the NON-PRIVATE baseline of the same recipe (privacy.dp=false)")
    from llmdp.config.yamlio import to_dict

    mine, theirs = cfg.data, bcfg.get("data") or {}
    for key in ("path", "dataset", "unit", "sequence_length", "eval"):
        a = to_dict(getattr(mine, key))
        if a != theirs.get(key):
            raise GenerateError(
                f"--baseline {run_dir}/config.yaml: data.{key} is {theirs.get(key)!r}, not the DP "
                f"run's {a!r}: its held-out units would not be the DP run's; give the baseline of "
                f"the same recipe (privacy.dp=false)")
    return rd.file("model")


def synthetic_store(file: str, cfg, tokenizer, cache_dir: str):
    """``file``'s records cut into the recipe's units (its tokenizer, encoding, packing)."""
    from llmdp.data.store import build_store
    from llmdp.run.planning import encoding_args, unit_spec

    try:
        return build_store(cache_dir, tokenizer=tokenizer, spec=unit_spec(cfg.data), data_path=file,
                           data_format="json", text_split=cfg.data.text_split,
                           on_bad_record="skip", progress=False, **encoding_args(cfg.data))
    except ValueError as e:
        raise GenerateError(f"FILE {file}: its records cannot be cut into the recipe's units "
                            f"({e}); give the output of `llmdp generate` for this run") from None


def quality(file, run_dir, *, baseline=None, reference=None, dp_epsilon: float | None = None,
            steps: int = 100, lr: float = 1e-3, batch_size: int = 16, max_rows: int = 1000,
            seed: int = 0, log=print) -> dict:
    from llmdp._fs import cache_root
    from llmdp.synthetic.source import load_source
    from llmdp.train.models import load_model as load_starting_model

    file = os.path.abspath(os.fspath(file))
    if not os.path.isfile(file):
        raise GenerateError(f"FILE {file}: no such file; give the output of `llmdp generate`")
    for flag, v in (("--steps", steps), ("--batch-size", batch_size), ("--max-rows", max_rows)):
        if v < 1:
            raise GenerateError(f"{flag} {v}: must be at least 1")
    if not (lr > 0 and np.isfinite(lr)):
        raise GenerateError(f"--lr {lr}: must be a finite number > 0")
    if seed < 0:
        raise GenerateError(f"--seed {seed}: must be an integer >= 0")
    if dp_epsilon is not None and not (dp_epsilon > 0 and np.isfinite(dp_epsilon)):
        raise GenerateError(f"--dp-epsilon {dp_epsilon}: must be a finite number > 0")
    source = load_source(run_dir)
    if source.config is None:
        raise GenerateError(f"RUN_DIR {source.path}: an export folder holds no held-out data; give "
                            f"the run folder it was exported from")
    cfg = _recipe(source)
    if cfg.data.eval is None:
        raise GenerateError(f"RUN_DIR {source.path}/config.yaml: data.eval is not set: the run held "
                            f"nothing out, so there is no real data to compare with; train with "
                            f"data.eval.fraction (e.g. 0.05)")
    baseline_model_dir = _check_baseline(baseline, cfg) if baseline is not None else None
    ref_info = None
    if reference is not None:
        from llmdp.synthetic.inputs import check_public_file

        ref_info = check_public_file(reference, "--reference", source)
        reference = os.path.abspath(os.fspath(reference))
    start, tokenizer = load_starting_model(cfg.model, cache_dir=os.path.join(cache_root(), "models"))
    tmp = tempfile.mkdtemp(prefix="llmdp-quality-")
    try:
        # the corpus cut into the recipe's units and embedded once, for every score below
        synth = synthetic_store(file, cfg, tokenizer, os.path.join(tmp, "synthetic"))
        synth_emb = embed(start, synth, max_rows)
        public = dp = None
        if reference is not None:
            public = _public_mauve(synth_emb, reference, ref_info, cfg, start, tokenizer, tmp,
                                   max_rows=max_rows, seed=seed)
        if dp_epsilon is not None:
            dp = _dp_mauve(file, synth_emb, source, cfg, start, tokenizer, dp_epsilon=dp_epsilon,
                           seed=seed, log=log)
        out = _measure(file, synth, synth_emb, source, cfg, start, tokenizer, tmp,
                       baseline=baseline, baseline_model_dir=baseline_model_dir, steps=steps,
                       lr=lr, batch_size=batch_size, max_rows=max_rows, seed=seed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    path = file + ".quality.internal.json"
    if public is not None:
        out["mauve"]["synthetic_vs_public_reference"] = public
    if dp is not None:
        out["mauve"]["synthetic_vs_held_out_dp"] = dp
    write(path, out)
    result = {**out, "written": path}
    if public is not None:
        result["written_public"] = _write_public(file, public)
    if dp is not None:
        result["written_dp"] = _write_dp(file, dp)
    log(render(out))
    return result


def _dp_mauve(file, synth_emb, source, cfg, start, tokenizer, *, dp_epsilon, seed, log) -> dict:
    """MAUVE against the held-out split as a DP release (`llmdp.synthetic.dp_quality`): every
    held-out unit's rows embedded (no row cap: which units count must not depend on the
    others), the synthetic rows (up to ``max_rows``: a public choice) fitting the buckets."""
    from llmdp.run.planning import held_out_store
    from llmdp.synthetic.dp_quality import release_mauve

    held = held_out_store(cfg, tokenizer, "eval", log=lambda *a, **k: None)
    counts = np.asarray(held.unit_row_count, dtype=np.int64)
    held_emb = embed(start, held, int(counts.sum()))
    unit_of_row = np.repeat(np.arange(held.num_units), counts)[:len(held_emb)]
    return release_mauve(cfg=cfg, source=source, synth_emb=synth_emb,
                         held_emb=held_emb, unit_of_row=unit_of_row, num_units=held.num_units,
                         target_epsilon=dp_epsilon, seed=seed, file=file, log=log)


# What the DP release's result holds that is not released: the score of the exact histogram
# and the number of held-out units (a count of private units; ``eval.count`` may keep it
# private). Both stay in the internal file.
PRIVATE_KEYS = ("internal_noise_free", "held_out_units")


def _write_dp(file: str, dp: dict) -> str:
    """``FILE.quality.dp.json``, and the released MAUVE with its (ε, δ) in the card."""
    path = file + ".quality.dp.json"
    write(path, {"label": "dp", "meaning": LABELS["dp"], "file": os.path.basename(file),
                 "mauve_vs_held_out": {k: v for k, v in dp.items() if k not in PRIVATE_KEYS}})
    _into_card(file, "quality_dp", {
        **{k: dp[k] for k in ("mauve", "epsilon", "delta", "accountant", "noise_multiplier",
                              "sensitivity", "buckets", "release_id", "adjacency")},
        "ledger_dataset_id": dp["ledger"]["dataset_id"]})
    return path


def _public_mauve(synth_emb, reference, ref_info, cfg, start, tokenizer, tmp, *, max_rows, seed) -> dict:
    """MAUVE of the synthetic rows against the public reference's rows (module docstring):
    nothing private is read (not the held-out split, not the training data)."""
    from llmdp.synthetic.mauve import mauve

    try:
        ref = synthetic_store(reference, cfg, tokenizer, os.path.join(tmp, "reference"))
    except GenerateError as e:
        raise GenerateError(str(e).replace(f"FILE {reference}", f"--reference {reference}")
                            .replace("give the output of `llmdp generate` for this run",
                                     "give a JSONL file of public records in the recipe's "
                                     "schema")) from None
    score = mauve(synth_emb, embed(start, ref, max_rows), seed=seed)
    return {"label": "public", "what": "the synthetic rows against the rows of a file declared "
            "public (--reference), on the starting model's embeddings", "reference": ref_info,
            **score}


def _into_card(file: str, key: str, value: dict) -> None:
    """``value`` under ``key`` in the synthetic data card beside ``file`` (JSON and Markdown),
    when that card describes this file."""
    from llmdp.synthetic.card import CARD_JSON, write_card

    folder = os.path.dirname(file)
    card_path = os.path.join(folder, CARD_JSON)
    if not os.path.isfile(card_path):
        return
    with open(card_path, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("file") == os.path.basename(file):
        data[key] = value
        write_card(folder, data)


def _write_public(file: str, public: dict) -> str:
    """``FILE.quality.public.json``, and the MAUVE in the synthetic data card beside the
    file (when it is there)."""
    path = file + ".quality.public.json"
    write(path, {"label": "public", "meaning": LABELS["public"], "file": os.path.basename(file),
                 "mauve_vs_public_reference": public})
    _into_card(file, "quality_public", {
        "mauve_vs_public_reference": {k: public[k] for k in ("mauve", "p_size", "q_size", "num_buckets")},
        "reference": public["reference"], "meaning": LABELS["public"]})
    return path


def _measure(file, synth, synth_emb, source, cfg, start, tokenizer, tmp, *, baseline,
             baseline_model_dir, steps, lr, batch_size, max_rows, seed) -> dict:
    from llmdp.run.planning import held_out_store
    from llmdp.synthetic import memorization as mem
    from llmdp.synthetic.generate import sampled_settings
    from llmdp.synthetic.mauve import mauve
    from llmdp.synthetic.source import load_model

    quiet = lambda *a, **k: None  # noqa: E731
    held = held_out_store(cfg, tokenizer, "eval", log=quiet)
    train_units = held_out_store(cfg, tokenizer, "train", log=quiet)
    pbs = cfg.train.physical_batch_size

    held_emb = embed(start, held, max_rows)
    # training rows spread over the store (a sample the size of the held-out one)
    step = max(1, train_units.num_units // max(1, len(held_emb)))

    class _Every:  # a view of every step-th training unit, for `embed`
        num_units = len(range(0, train_units.num_units, step))
        unit_row_count = train_units.unit_row_count[::step]

        @staticmethod
        def rows(units, width=None):
            return train_units.rows(np.asarray(units, dtype=np.int64) * step, width=width)

    def scores(store, what, emb=None):
        emb = embed(start, store, max_rows) if emb is None else emb
        return {"label": "internal", "what": what, **mauve(emb, held_emb, seed=seed)}

    out: dict = {"internal": BANNER, "labels": LABELS, "file": os.path.basename(file),
                 "run_id": source.run_id, "held_out_units": held.num_units,
                 "synthetic_units": synth.num_units,
                 "embeddings": "the run's starting model (public): last hidden state, mean-pooled "
                               "over each row's tokens",
                 "mauve": {"synthetic_vs_held_out": scores(synth, "the synthetic rows against the "
                                                                   "held-out rows", synth_emb),
                           "reference_training_vs_held_out": scores(
                               _Every, "training rows against held-out rows (two samples of the "
                                       "private distribution: the ceiling)")}}
    losses = {"starting_model": {"label": "internal", **held_out_loss(start, held, pbs)}}
    dp_model, _ = load_model(source.model_dir)
    losses["dp_model"] = {"label": "internal", **held_out_loss(dp_model, held, pbs)}
    del dp_model
    tstr = copy.deepcopy(start)
    setup = train_on(tstr, synth, steps=steps, lr=lr, batch_size=batch_size, seed=seed)
    losses["train_on_synthetic"] = {"label": "internal", **held_out_loss(tstr, held, pbs)}
    del tstr
    if baseline is not None:
        bmodel, _ = load_model(baseline_model_dir)
        losses["non_private_baseline"] = {"label": "internal", **held_out_loss(bmodel, held, pbs)}
        del bmodel
        brecords = mem.baseline_samples(baseline, source.schema, sampled_settings(file), 16)
        bfile = os.path.join(tmp, "baseline-samples.jsonl")
        with open(bfile, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in brecords)
        bstore = synthetic_store(bfile, cfg, tokenizer, tmp)
        out["mauve"]["non_private_samples_vs_held_out"] = scores(
            bstore, "the NON-PRIVATE baseline's samples (the corpus' settings) against the "
                    "held-out rows")
        btstr = copy.deepcopy(start)
        train_on(btstr, bstore, steps=steps, lr=lr, batch_size=batch_size, seed=seed)
        losses["train_on_non_private_samples"] = {"label": "internal",
                                                  **held_out_loss(btstr, held, pbs)}
        del btstr
    out["train_on_synthetic"] = setup
    out["held_out_loss"] = losses
    dp = ((source.report.get("evaluation") or {}).get("dp") or [])
    if dp:
        out["dp_release"] = {"label": "dp", "what": "the run's DP evaluation of the DP model's "
                             "held-out loss (privacy_report.json: evaluation.dp)", **dp[-1]}
    return out


def render(r: dict) -> str:
    lines = [r["internal"]]
    for key, m in r["mauve"].items():
        if m["label"] == "dp":
            lines.append(f"[dp] MAUVE {key.replace('_', ' ')}: {m['mauve']:.4f} (ε = "
                         f"{m['epsilon']:.4f} at δ = {m['delta']:.3g}, {m['buckets']} buckets, "
                         f"{m['held_out_units']} held-out units)")
            if m.get("internal_noise_free") is not None:
                lines.append(f"[internal] the same buckets without the noise: "
                             f"{m['internal_noise_free']:.4f}")
            continue
        lines.append(f"[{m['label']}] MAUVE {key.replace('_', ' ')}: {m['mauve']:.4f} "
                     f"({m['p_size']} vs {m['q_size']} rows, {m['num_buckets']} clusters)")
    for key, v in r["held_out_loss"].items():
        lines.append(f"[{v['label']}] held-out loss, {key.replace('_', ' ')}: {v['loss']:.4f}")
    d = r.get("dp_release")
    if d and d.get("loss") is not None:
        lines.append(f"[dp] held-out loss of the DP model, DP release of the run: {d['loss']:.4f}")
    return "\n".join(lines)


def write(path: str, result: dict) -> None:
    from llmdp._fs import atomic_write

    atomic_write(path, lambda f: json.dump(result, f, indent=2), text=True)
