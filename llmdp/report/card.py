"""The model card (``README.md``) of an export: YAML metadata (license, base_model,
library_name, tags, datasets when public, and a ``differential_privacy`` block) and a
privacy section, generated from the publishable report (`llmdp.record.publish.publishable_report`)
with local paths already scrubbed by `llmdp.hub.export.export_run`. An unverified export's card
lists, at the top, the checks that failed.
"""

from __future__ import annotations

from llmdp.audit.section import audit_markdown
from llmdp.evaluation.report import evaluation_markdown
from llmdp.report.render import plain_guarantee


def model_card(report: dict, cfg: dict, *, fmt: str, base_model: str | None, license: str | None,
               unverified: list[str], repo_id: str | None = None):
    """The ``huggingface_hub.ModelCard`` of an export, generated from the run's report."""
    from huggingface_hub import ModelCard, ModelCardData  # lazy: huggingface_hub is slow to import

    data_cfg, model_cfg = cfg["data"], cfg["model"]
    tags = ["differential-privacy", "dp-sgd", "llmdp", "text-generation"]
    if fmt == "adapter":
        tags += ["lora", "peft"]
    if (report.get("tokenizer") or {}).get("composed_into_guarantee"):
        tags.append("private-tokenizer")
    dp = {
        "epsilon": report["epsilon"], "delta": report["delta"], "accountant": report["accountant"],
        "epsilon_by_accountant": report["epsilon_by_accountant"], "unit": report["unit"],
        "adjacency": report["adjacency"], "accounting_relation": report.get("accounting_relation"),
        "noise_multiplier": report["noise_multiplier"],
        "sampling_probability": report["sampling_probability"], "steps": report["steps"],
        "dataset_size": report["dataset_size"], "max_grad_norm": report["max_grad_norm"],
        "rng": report.get("rng_mode"), "verified": not unverified,
    }
    card_data = ModelCardData(
        license=license or "other",
        base_model=base_model,
        library_name="peft" if fmt == "adapter" else "transformers",
        tags=tags,
        datasets=[data_cfg["dataset"]] if data_cfg.get("dataset") else None,
        pipeline_tag="text-generation",
        differential_privacy=dp,
        **_eval_results(report.get("evaluation"), repo_id or cfg["output"]["name"], report),
    )
    name = repo_id or cfg["output"]["name"]
    eps = report["epsilon_by_accountant"]
    s = report["sampling"]
    lines = [f"# {name}", ""]
    if unverified:
        lines += ["> **UNVERIFIED EXPORT.** Published with `--allow-unverified`; these checks failed, "
                  "so the guarantee below may not hold for these weights:", ">"]
        lines += [f"> - {p}" for p in unverified] + [""]
    start = _start_name(report.get("starting_model"))
    what = {"adapter": f"a LoRA adapter (PEFT) for `{base_model}`",
            "merged": "full weights (a LoRA adapter merged into its base)" + (
                f", base `{base_model}`" if base_model else f", base {start}" if start else ""),
            "full": "full weights" + (f", fine-tuned from `{base_model}`" if base_model else
                                      f", fine-tuned from {start}" if start else
                                      ", trained from a randomly initialized model")}[fmt]
    lines += [
        f"A causal language model trained with **differential privacy** (DP-SGD) by llmdp on "
        f"private data: {what}.",
        "",
        "## Privacy",
        "",
        plain_guarantee(report),
        "",
        f"**Guarantee: ({report['epsilon']:.4f}, {report['delta']:.3g})-differential privacy** with "
        f"respect to {report['adjacency']}, accounted with {report['accountant'].upper()} ("
        + "; ".join(f"{k.upper()}: ε = {v:.4f}" for k, v in eps.items()) + ").",
        "",
        "| item | value |",
        "| --- | --- |",
        f"| ε at δ | {report['epsilon']:.4f} at δ = {report['delta']:.3g} |",
        f"| Unit of privacy | {report['unit']}: {report['unit_description']} |",
        *([f"| Record format | {report['record_format']} |"] if report.get("record_format") else []),
        f"| Contribution bound | {report['contribution_bound']} |",
        f"| Adjacency | {report['adjacency']} |",
        *([f"| Published counts (public) | {report['published_counts']} |"]
          if report.get("published_counts") else []),
        f"| DP setting | {report['dp_setting']} |",
        f"| What the guarantee covers | {report['mechanism_output']} |",
        *([f"| Checkpoints | {report['checkpoints']} |"] if report.get("checkpoints") else []),
        *([f"| Starting model | {report['guarantee_scope']} |"] if report.get("guarantee_scope") else []),
        *([f"| Hyper-parameters | {report['hyperparameters']['note']} |"] if report.get("hyperparameters") else []),
        f"| Accounting | {report['accountant'].upper()}; " + ", ".join(
            f"{k.upper()} ε = {v:.4f}" for k, v in eps.items()) + " |",
        *([f"| Mechanism | {report['correlated_noise']['mechanism']} (correlated noise) |"]
          if report.get("correlated_noise") else []),
        f"| Sampling | {s['assumed']}; used: {s['used']} |",
        f"| Dataset size N / expected batch q·N | {report['dataset_size']} units / "
        f"{report['expected_batch_size']:g} units (q = {report['sampling_probability']:.6g}) |",
        f"| Steps T | {report['steps']} in the ledger ({report['steps_completed']} completed) |",
        f"| Noise multiplier σ / clipping norm C | {report['noise_multiplier']:.6g} / {report['max_grad_norm']:g} "
        f"({report['clipping']}) |",
        f"| RNG | {report.get('rng_mode')}" + (f": {report['rng_warning']}" if report.get("rng_warning") else
                                               " (fresh OS entropy for sampling and noise)") + " |",
        f"| Tokenizer | {(report.get('tokenizer') or {}).get('note', '–')} |",
        f"| Status | {report['status']}" + (f" ({report['stopped']})" if report.get("stopped") else "") + " |",
        "",
        "### Covered by the guarantee",
        "",
        *[f"- {x}" for x in report["data_accesses_covered"]],
        "",
        "### Not covered",
        "",
        *[f"- {x}" for x in report["data_accesses_not_covered"]],
        "- anything about the private data that the base model or public data already reveal",
        "",
        "### Releases (the ledger)",
        "",
        "| run | count | mechanism |",
        "| --- | ---: | --- |",
        *[f"| {r['run_id']} | {r['count']} | {r['mechanism']} |" for r in report["ledger"]["releases"]],
        "",
        "The files `privacy_report.json`, `privacy_report.md`, `privacy_report.png` and `ledger.jsonl` "
        "hold the publishable report and the ledger it was computed from (every (event, count) release; "
        "anyone can recompute ε from it with dp-accounting). They carry DP outputs and public "
        "configuration only: statistics and metrics computed on the private data without DP, and "
        "fingerprints of that data, are not published.",
        "",
        *evaluation_markdown(report.get("evaluation")),
        *audit_markdown(report.get("empirical_audit")),
        "## Use",
        "",
        "```python",
    ]
    ref = repo_id or "PATH_OR_REPO"
    if fmt == "adapter":
        lines += ["from peft import PeftModel",
                  "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  f"base = AutoModelForCausalLM.from_pretrained({base_model!r})",
                  f"model = PeftModel.from_pretrained(base, {ref!r})",
                  f"tokenizer = AutoTokenizer.from_pretrained({ref!r})"]
    else:
        lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer",
                  f"model = AutoModelForCausalLM.from_pretrained({ref!r})",
                  f"tokenizer = AutoTokenizer.from_pretrained({ref!r})"]
    lora = model_cfg.get("lora")
    optim = cfg["optim"]
    lines += [
        "```",
        "",
        "## Training",
        "",
        f"- model: {'LoRA r=' + str(lora['r']) + ' on ' + ', '.join([*lora['target_modules'], *lora.get('target_parameters', ())]) if lora else 'full fine-tuning'}"
        f"; dtype {model_cfg.get('dtype')}",
        f"- data: {data_cfg.get('dataset') or 'a private corpus (not published)'}; unit "
        f"{data_cfg['unit']}, sequences of {data_cfg['sequence_length']} tokens",
        f"- optimizer: {optim['name']}, lr {optim['lr']:g}, schedule {optim['schedule']}",
        f"- steps: {report['steps_completed']}, expected batch {report['expected_batch_size']:g} units",
        "",
    ]
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(lines))


def _start_name(start) -> str | None:
    """The report's starting model as the card's first sentence names it (a local checkpoint
    has no Hub id to be the base: its shown name and the llmdp run it came from); None for a
    model trained from random weights (the report has no starting model then)."""
    if not isinstance(start, dict):
        return None
    name = f"`{start.get('shown') or start.get('name') or 'a checkpoint'}`"
    return name + (f" (llmdp run {start['run_id']})" if start.get("run_id") else "")


def public_model_card(report: dict, cfg: dict, *, fmt: str, base_model: str | None,
                      license: str | None, unverified: list[str], repo_id: str | None = None):
    """The card of a run on data its recipe declared public (``data.public: true``): its first
    line (after the metadata) is the run's declaration (`llmdp.record.baseline.public_banner`);
    no ε, no differential_privacy block: llmdp makes no guarantee about such a model."""
    from huggingface_hub import ModelCard, ModelCardData  # lazy: huggingface_hub is slow to import

    data_cfg, model_cfg, optim = cfg["data"], cfg["model"], cfg["optim"]
    tags = ["llmdp", "text-generation", "declared-public-data"] + (["lora", "peft"] if fmt == "adapter" else [])
    card_data = ModelCardData(
        license=license or "other", base_model=base_model,
        library_name="peft" if fmt == "adapter" else "transformers", tags=tags,
        datasets=[data_cfg["dataset"]] if data_cfg.get("dataset") else None,
        pipeline_tag="text-generation",
    )
    name = repo_id or cfg["output"]["name"]
    lora = model_cfg.get("lora")
    lines = [report["banner"], "", f"# {name}", ""]
    if unverified:
        lines += ["> **UNVERIFIED EXPORT.** Published with `--allow-unverified`; these checks failed:", ">"]
        lines += [f"> - {p}" for p in unverified] + [""]
    lines += [
        "A causal language model trained by llmdp **without differential privacy**, on data its "
        "recipe declared public (`data.public: true`). llmdp makes **no privacy guarantee** for "
        "this model: it may reveal any training example. Whether the data may be published, and "
        "used this way, is the responsibility of whoever declared it public.",
        "",
        "| item | value |",
        "| --- | --- |",
        f"| Training data | {data_cfg.get('dataset') or data_cfg.get('path')} (declared public) |",
        "| Privacy | none: no clipping, no noise, no ε |",
        f"| Status | {report['status']} |",
        f"| Steps | {report['steps_completed']} of {report['steps_planned']} |",
        f"| Unit / dataset size | {report['unit']} / {report['dataset_size']} units |",
        f"| Model | {'LoRA r=' + str(lora['r']) if lora else 'full fine-tuning'}; dtype {model_cfg.get('dtype')} |",
        f"| Optimizer | {optim['name']}, lr {optim['lr']:g}, schedule {optim['schedule']} |",
        "",
        *evaluation_markdown(report.get("evaluation")),
    ]
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(lines))


def _dp_metrics_with_std(m: dict) -> list[tuple[str, float, float]]:
    """(metric, value, std of its DP noise) of one DP evaluation release; perplexity's std is
    the loss std carried through exp (delta method: exp(loss)·std(loss))."""
    return [("loss", m["loss"], m["loss_std"]),
            ("perplexity", m["perplexity"], m["perplexity"] * m["loss_std"]),
            ("accuracy", m["accuracy"], m["accuracy_std"])]


def _eval_results(ev: dict | None, model_name: str, report: dict) -> dict:
    """The card's ``model-index`` (Hugging Face format): the last DP evaluation and the
    last metrics on public held-out data, the only evaluations that may be published."""
    from huggingface_hub import EvalResult  # lazy: huggingface_hub is slow to import

    if not ev:
        return {}
    results = []
    dp = (ev.get("dp") or [])[-1:]
    for m in dp:
        name = f"held-out private units, released with DP (ε = {report['epsilon']:.3g} for the whole run)"
        for metric, value, std in _dp_metrics_with_std(m):
            # A DP metric is never published without the std of its noise: in the name
            # (what the Hub shows) and as a metric argument (what tools read).
            results.append(EvalResult(task_type="text-generation", dataset_type="private",
                                      dataset_name=name, metric_type=metric, metric_value=value,
                                      metric_name=f"DP {metric} ± {std:.3g} (std of the DP noise; "
                                                  f"after step {m['step']})",
                                      metric_args={"dp_noise_std": std}))
    for m in (ev.get("public") or [])[-1:]:
        for metric in ("loss", "perplexity", "accuracy"):
            results.append(EvalResult(task_type="text-generation", dataset_type="public",
                                      dataset_name="held-out public data", metric_type=metric,
                                      metric_value=m[metric],
                                      metric_name=f"{metric} (after step {m['step']})"))
    return {"eval_results": results, "model_name": model_name} if results else {}
