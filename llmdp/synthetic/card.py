"""``synthetic_data_card.json`` and ``.md`` beside a synthetic corpus: the guarantee it
inherits from the DP model (copied from the model's report, never recomputed), the
provenance chain, the generation settings and seed, and the corpus's public statistics.
Meant to travel with the corpus: no local path, nothing computed on private data."""

from __future__ import annotations

import json
import os

from llmdp._fs import atomic_write

CARD_JSON = "synthetic_data_card.json"
CARD_MD = "synthetic_data_card.md"
VERSION = 1

STATEMENT = ("Every record is post-processing of the DP model: it was sampled from the model's "
             "final weights with the public settings below (public prompts or labels only, no "
             "filter, a number of records fixed in advance), so the corpus carries the model's "
             "(ε, δ) guarantee for the same privacy unit, and nothing more: whatever the model "
             "may reveal about a unit within that guarantee, the corpus may too.")


def card(source, settings: dict, inputs: dict, stats: dict, out_file: str) -> dict:
    g = source.guarantee
    return {
        "synthetic_data_card": VERSION,
        "file": os.path.basename(out_file),
        "records": stats.get("records"),
        "statement": STATEMENT,
        "guarantee": {k: g.get(k) for k in ("epsilon", "delta", "accountant", "epsilon_by_accountant",
                                            "unit", "unit_description", "adjacency",
                                            "guarantee_scope", "dp_setting")},
        "guarantee_read_from": f"{g.get('read_from')} of llmdp run {source.run_id} (not recomputed)",
        "seeded_model": (None if not source.seeded else
                         {"sources": list(source.seeded), "statement": g.get("rng_warning")}),
        "model": {"source": source.kind, "run_id": source.run_id, "shown": source.shown},
        "provenance": source.chain,
        "generation": {**{k: v for k, v in settings.items() if k not in ("prompts", "labels")},
                       "prompts": len(settings.get("prompts") or []),
                       "labels": len(settings.get("labels") or []),
                       "randomness": "record i draws from its own torch.Generator seeded by "
                                     "SHA-256(seed, i): the same records whatever the batch "
                                     "size or the workers",
                       "inputs": inputs,
                       "schema": source.schema.describe()},
        "statistics": stats,
    }


def write_card(folder: str, data: dict) -> tuple[str, str]:
    pj, pm = os.path.join(folder, CARD_JSON), os.path.join(folder, CARD_MD)
    atomic_write(pj, lambda f: (json.dump(data, f, indent=2, ensure_ascii=False), f.write("\n")), text=True)
    atomic_write(pm, lambda f: f.write(render(data)), text=True)
    return pj, pm


def render(c: dict) -> str:
    g, gen, st = c["guarantee"], c["generation"], c["statistics"]
    eps = g.get("epsilon")
    lines = [
        f"# Synthetic data card: {c['file']}",
        "",
        f"**Differential privacy: ε = {eps!r} at δ = {g.get('delta')!r}** ({g.get('accountant')} "
        f"accountant), per privacy unit: {g.get('unit_description') or g.get('unit')}.",
        "",
        f"> {c['statement']}",
        "",
    ]
    if c.get("seeded_model"):
        lines += [f"> **Seeded model.** {c['seeded_model']['statement']}", ""]
    lines += [
        "| item | value |",
        "| --- | --- |",
        f"| Records | {c['records']} |",
        f"| ε (δ = {g.get('delta')!r}) | {eps!r} |",
        f"| Privacy unit | {g.get('unit')} |",
        f"| Adjacency | {g.get('adjacency')} |",
        f"| Guarantee read from | {c['guarantee_read_from']} |",
        f"| Scope | {g.get('guarantee_scope')} |",
        f"| Model | {c['model']['source']} {c['model']['shown']} (llmdp run {c['model']['run_id']}) |",
        "",
        "## Provenance chain (nearest first)",
        "",
        *[f"- llmdp run {a.get('run_id')}: {a.get('kind')}"
          + (f" (data declared public: {a['public_source']})" if a.get("public_source") else "")
          for a in c["provenance"]],
        "",
        "## Generation",
        "",
        f"- seed: {gen.get('seed')}; temperature {gen.get('temperature')}; top-p {gen.get('top_p')}; "
        f"at most {gen.get('max_new_tokens')} new tokens per record",
        f"- records requested: {gen.get('num_records')} (fixed in advance, not chosen by any data)",
        f"- randomness: {gen.get('randomness')}",
        f"- schema: {json.dumps(gen.get('schema'))}",
    ]
    for flag, info in (gen.get("inputs") or {}).items():
        lines.append(f"- {flag}: {info.get('file')} ({info.get('entries')} entries), declared "
                     f"{info.get('declared')}")
    if not gen.get("inputs"):
        lines.append("- no prompts or labels: unconditional sampling")
    lines += [
        "",
        "## Statistics (public: computed on the synthetic records only)",
        "",
        f"- records: {st.get('records')}; empty texts: {st.get('empty_texts')}; duplicate texts: "
        f"{st.get('duplicate_texts')}",
        f"- length in words: {_fmt(st.get('length_words'))}",
        f"- length in characters: {_fmt(st.get('length_characters'))}",
    ]
    if "length_tokens" in st:
        lines.append(f"- length in tokens: {_fmt(st['length_tokens'])}")
    lines.append(f"- vocabulary: {st.get('vocabulary_words')} distinct words"
                 + (f", {st['vocabulary_tokens']} distinct tokens" if "vocabulary_tokens" in st else ""))
    for name, f in (st.get("fields") or {}).items():
        lines.append(f"- field `{name}`: present in {f.get('present')}"
                     + (f", {f['distinct']} distinct values" if "distinct" in f else ""))
    qd = c.get("quality_dp")
    if qd:
        lines += ["", "## Quality (a DP release on the private held-out split)", "",
                  f"- MAUVE against the held-out split: {qd['mauve']:.4f}, released with ε = "
                  f"{qd['epsilon']:.4f} at δ = {qd['delta']!r} ({qd['accountant']}; Gaussian noise "
                  f"multiplier {qd['noise_multiplier']:.4f} on a histogram over {qd['buckets']} "
                  f"buckets fitted on the synthetic rows; {qd['adjacency']}), recorded in the "
                  f"dataset ledger {qd['ledger_dataset_id']!r} (release {qd['release_id']}): "
                  f"this ε is spent on the dataset in addition to the model's"]
    q = c.get("quality_public")
    if q:
        m, ref = q["mauve_vs_public_reference"], q.get("reference") or {}
        lines += ["", "## Quality (public: the corpus against a file declared public)", "",
                  f"- MAUVE against {ref.get('file')} (sha256 {str(ref.get('sha256'))[:12]}…, "
                  f"declared {ref.get('declared')}): {m['mauve']:.4f} ({m['p_size']} vs "
                  f"{m['q_size']} rows, {m['num_buckets']} clusters; `llmdp synthetic quality "
                  f"--reference`)"]
    lines.append("")
    return "\n".join(lines)


def _fmt(s: dict | None) -> str:
    if not s or not s.get("count"):
        return "none"
    return (f"mean {s['mean']:.1f}, median {s['median']:.0f}, p10 {s['p10']:.0f}, p90 "
            f"{s['p90']:.0f}, min {s['min']:.0f}, max {s['max']:.0f}")
