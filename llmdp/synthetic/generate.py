"""`llmdp generate RUN_DIR|EXPORT_DIR --num-records N --out FILE`: a synthetic corpus sampled
from a DP model, with its card.

1. the source is checked (`llmdp.synthetic.source`: a DP model, no NON-PRIVATE ancestor,
   verified, a seeded model's statement present), prompts / labels are public files
   (`llmdp.synthetic.inputs`), no filter;
2. the output is opened or resumed (`llmdp.synthetic.output`); records from the first
   missing index are sampled in blocks of ``--batch-size`` (`llmdp.synthetic.sampling`),
   here or on Ray Data (``--ray-data``: ``map_batches`` over blocks of record indices on an
   actor pool of ``--workers``, each actor loading the model once), and appended in index
   order as they come, with a progress bar on stderr;
3. ``synthetic_data_card.json`` / ``.md`` beside the file: the model's guarantee, the
   provenance chain, the settings and the public statistics of the corpus;
4. with ``--memorization``: the internal memorization check
   (`llmdp.synthetic.memorization`), written to ``FILE.memorization.internal.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict

from llmdp.synthetic.sampling import Settings
from llmdp.synthetic.source import GenerateError, Schema


def _check_flags(num_records, temperature, top_p, max_new_tokens, batch_size, workers, seed, num_users):
    if num_records < 1:
        raise GenerateError(f"--num-records {num_records}: generate at least 1 record")
    if not (math.isfinite(temperature) and temperature > 0):
        raise GenerateError(f"--temperature {temperature}: must be a finite number > 0 (1.0: the model's own distribution)")
    if not (0 < top_p <= 1):
        raise GenerateError(f"--top-p {top_p}: must be in (0, 1] (1.0: no nucleus cut)")
    if max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    if batch_size < 1:
        raise GenerateError(f"--batch-size {batch_size}: must be at least 1")
    if workers < 1:
        raise GenerateError(f"--workers {workers}: must be at least 1")
    if seed < 0:
        raise GenerateError(f"--seed {seed}: must be an integer >= 0")
    if num_users is not None and num_users < 1:
        raise GenerateError(f"--num-users {num_users}: must be at least 1")


def prepare(source_path, *, num_records: int, seed: int = 0, temperature: float = 1.0,
            top_p: float = 1.0, max_new_tokens: int = 128, prompts=None, labels=None,
            num_users: int | None = None, filter_with=None):
    """(source, settings, inputs): everything checked before any file is written."""
    from llmdp.synthetic.inputs import check_public_file, read_lines, refuse_filter
    from llmdp.synthetic.source import load_source

    source = load_source(source_path)
    if filter_with is not None:
        refuse_filter(filter_with, source)
    inputs, lists = {}, {"prompts": (), "labels": ()}
    for flag, path in (("--prompts", prompts), ("--labels", labels)):
        if path is not None:
            info = check_public_file(path, flag, source)
            entries = tuple(read_lines(path))
            inputs[flag] = {**info, "entries": len(entries)}
            lists[flag[2:]] = entries
    if source.schema.mode != "text" and not (lists["prompts"] or lists["labels"]):
        raise GenerateError(
            f"--prompts: the model was trained on {source.schema.mode} records, whose user turns "
            f"are never trained on, so it cannot invent them; give --prompts PUBLIC_FILE (one "
            f"user turn a line) or --labels PUBLIC_FILE")
    if source.schema.user_field and num_users is None:
        num_users = max(1, num_records // 10)
    settings = Settings(num_records=num_records, seed=seed, temperature=temperature, top_p=top_p,
                        max_new_tokens=max_new_tokens, prompts=lists["prompts"],
                        labels=lists["labels"],
                        num_users=num_users if source.schema.user_field else None)
    return source, settings, inputs


def fingerprint(source, settings: Settings) -> dict:
    """What the sidecar records and a rerun must match (not the batch size nor the workers)."""
    return {**settings.to_dict(), "model": {"kind": source.kind, "run_id": source.run_id,
                                            "shown": source.shown},
            "schema": source.schema.describe()}


def generate(source_path, *, out, num_records: int, seed: int = 0, temperature: float = 1.0,
             top_p: float = 1.0, max_new_tokens: int = 128, prompts=None, labels=None,
             num_users: int | None = None, batch_size: int = 16, ray_data: bool = False,
             workers: int = 1, filter_with=None, memorization: bool = False,
             baseline=None, progress: bool = True, log=print) -> dict:
    from llmdp.synthetic.card import card, write_card
    from llmdp.synthetic.output import Output
    from llmdp.synthetic.sampling import check_lengths
    from llmdp.synthetic.source import load_model
    from llmdp.synthetic.stats import read_records, statistics

    _check_flags(num_records, temperature, top_p, max_new_tokens, batch_size, workers, seed, num_users)
    if baseline is not None and not memorization:
        raise GenerateError("--baseline: it is read by the memorization check only; add --memorization")
    source, settings, inputs = prepare(
        source_path, num_records=num_records, seed=seed, temperature=temperature, top_p=top_p,
        max_new_tokens=max_new_tokens, prompts=prompts, labels=labels, num_users=num_users,
        filter_with=filter_with)
    if memorization and source.config is None:
        raise GenerateError(f"--memorization: {source.path} is an export folder, which holds no "
                            f"training data; run `llmdp synthetic check FILE RUN_DIR` with the run "
                            f"folder it was exported from")
    model, tokenizer = load_model(source.model_dir)
    check_lengths(model, tokenizer, source.schema, settings)
    output = Output(out, fingerprint(source, settings))
    start = output.open()
    if start:
        log(f"resuming {output.path} at record {start} of {num_records}")
    bar = _bar(num_records, start, progress)
    try:
        if start < num_records:
            if ray_data:
                del model
                _sample_on_ray(source, settings, start, batch_size, workers, output, bar, log)
            else:
                _sample_here(model, tokenizer, source.schema, settings, start, batch_size, output, bar)
    finally:
        bar.close()
        output.close(complete=output.done >= num_records)
    records = read_records(output.path)
    stats = statistics(records, source.schema, tokenizer)
    data = card(source, settings.to_dict(), inputs, stats, output.path)
    pj, pm = write_card(os.path.dirname(output.path), data)
    g = source.guarantee
    log(f"wrote {len(records)} records to {output.path}; {os.path.basename(pm)}: ε = "
        f"{g['epsilon']:.4f} at δ = {g['delta']:.3g} ({g['unit']} unit), every record "
        f"post-processing of the DP model")
    result = {"out": output.path, "records": len(records), "card": pj, "card_md": pm,
              "resumed_at": start}
    if memorization:
        from llmdp.synthetic import memorization as mem

        base = mem.baseline_samples(baseline, source.schema, settings, batch_size) if baseline else None
        res = mem.check(source, records, tokenizer, baseline_records=base, baseline_run=baseline)
        path = output.path + ".memorization.internal.json"
        mem.write(path, res)
        log(mem.render(res))
        result["memorization"] = path
    return result


def _bar(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="rec", desc="generating", file=sys.stderr,
                disable=not enabled, dynamic_ncols=True)


def _sample_here(model, tokenizer, schema: Schema, settings: Settings, start: int,
                 batch_size: int, output, bar) -> None:
    from llmdp.synthetic.sampling import records_for

    for s in range(start, settings.num_records, batch_size):
        idx = list(range(s, min(s + batch_size, settings.num_records)))
        recs = records_for(model, tokenizer, schema, settings, idx)
        output.append([json.dumps(r, ensure_ascii=False) for r in recs])
        bar.update(len(recs))


class BlockSampler:
    """A Ray Data actor: the model loaded once; one block of record indices per call."""

    def __init__(self, model_dir: str, schema: dict, settings: dict, start: int, block: int):
        from llmdp.synthetic.source import load_model

        self.model, self.tokenizer = load_model(model_dir)
        self.schema = Schema(**schema)
        self.settings = Settings(**{**settings, "prompts": tuple(settings["prompts"]),
                                    "labels": tuple(settings["labels"])})
        self.start, self.block = start, block

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        from llmdp.synthetic.sampling import records_for

        starts, lines = [], []
        for b in batch["id"].tolist():
            s = self.start + int(b) * self.block
            idx = list(range(s, min(s + self.block, self.settings.num_records)))
            recs = records_for(self.model, self.tokenizer, self.schema, self.settings, idx)
            starts.append(s)
            lines.append(json.dumps([json.dumps(r, ensure_ascii=False) for r in recs]))
        return {"start": np.asarray(starts, dtype=np.int64), "lines": np.asarray(lines, dtype=object)}


def _sample_on_ray(source, settings: Settings, start: int, batch_size: int, workers: int,
                   output, bar, log) -> None:
    import logging
    import tempfile

    import ray
    import ray.data

    local = None
    if not ray.is_initialized():
        from llmdp.base import localray

        localray.quiet_ray_notices()
        local = localray.start(tempfile.mkdtemp(prefix="llmdp-generate-ray-"), log=log,
                               num_cpus=max(workers, 1), include_dashboard=False,
                               logging_level="WARNING", log_to_driver=False, configure_logging=True)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.execution_options.preserve_order = True
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        blocks = math.ceil((settings.num_records - start) / batch_size)
        ds = ray.data.range(blocks, override_num_blocks=blocks)
        s = settings.to_dict()
        s.pop("sampler_version")
        out = ds.map_batches(
            BlockSampler, batch_size=1, batch_format="numpy", num_cpus=1,
            compute=ray.data.ActorPoolStrategy(size=workers),
            fn_constructor_kwargs={"model_dir": source.model_dir, "schema": asdict(source.schema),
                                   "settings": s, "start": start, "block": batch_size})
        pending: dict[int, list[str]] = {}
        nxt = start
        for row in out.iter_rows():  # in order (preserve_order); re-ordered here all the same
            pending[int(row["start"])] = json.loads(row["lines"])
            while nxt in pending:
                lines = pending.pop(nxt)
                output.append(lines)
                bar.update(len(lines))
                nxt += len(lines)
        if nxt != settings.num_records:
            raise GenerateError(f"Ray Data returned records up to {nxt}, not {settings.num_records}; "
                                f"run the same command again to resume")
    finally:
        if local is not None:
            ray.shutdown()
            if local is not True:
                local.stop()


def check_file(file, run_dir, *, baseline=None, k: int = 8, batch_size: int = 16, log=print) -> dict:
    """`llmdp synthetic check FILE RUN_DIR`: the memorization check of a finished corpus."""
    from llmdp.synthetic import memorization as mem
    from llmdp.synthetic.source import load_model, load_source
    from llmdp.synthetic.stats import read_records

    file = os.path.abspath(os.fspath(file))
    if not os.path.isfile(file):
        raise GenerateError(f"FILE {file}: no such file; give the output of `llmdp generate`")
    if k < 1:
        raise GenerateError(f"--k {k}: the n-gram length must be at least 1")
    source = load_source(run_dir)
    if source.config is None:
        raise GenerateError(f"RUN_DIR {source.path}: an export folder holds no training data; give "
                            f"the run folder it was exported from")
    try:
        records = read_records(file)
    except ValueError as e:
        raise GenerateError(f"FILE {file}: not JSON lines ({e}); give the output of `llmdp generate`") from None
    _, tokenizer = load_model(source.model_dir)
    base = None
    if baseline is not None:
        base = mem.baseline_samples(baseline, source.schema, sampled_settings(file), batch_size)
    res = mem.check(source, records, tokenizer, k=k, baseline_records=base, baseline_run=baseline)
    path = file + ".memorization.internal.json"
    mem.write(path, res)
    log(mem.render(res))
    return {**res, "written": path}


def sampled_settings(file: str, flag: str = "--baseline") -> Settings:
    """The settings ``file`` was sampled with (its sidecar), to sample a NON-PRIVATE baseline
    the same way (internal comparisons only)."""
    from llmdp.synthetic.output import sidecar_path

    try:
        with open(sidecar_path(file), encoding="utf-8") as f:
            raw = json.load(f)["settings"]
    except (OSError, ValueError, KeyError):
        raise GenerateError(f"{flag}: {sidecar_path(file)} (the settings the corpus was "
                            f"sampled with) is missing or unreadable; the baseline is sampled "
                            f"with the same settings") from None
    fields = {k: raw[k] for k in ("num_records", "seed", "temperature", "top_p",
                                  "max_new_tokens", "num_users")}
    return Settings(**fields, prompts=tuple(raw.get("prompts") or ()),
                    labels=tuple(raw.get("labels") or ()))
