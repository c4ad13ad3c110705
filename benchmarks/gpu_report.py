"""The tables of a ``benchmarks/gpu.sh`` run, from the JSON and logs its stages left.

    python benchmarks/gpu_report.py DIR      # DIR: gpu.sh's WORK folder (or its results.tgz unpacked)

Markdown on stdout: the DP step per shape (every method's time and peak memory against the
non-private row of the same shape: peers ran in their own ``clipping.py`` call, so their
ratios are across calls of one run on one machine), what the profiled steps issued (device
kernels, launch and sync calls, the host-bound gap), their top items, the kernels against
cuBLAS, the Gram path's bound shares, the massive-activation cases, the tests' summary and
the noise rate. A stage that did not run (or ran out of time) is said to be missing.
"""

from __future__ import annotations

import json
import os
import re
import sys


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _rows(d: str, *names: str) -> list:
    rows = []
    for n in names:
        data = _load(os.path.join(d, n + ".json"))
        if data:
            rows += [dict(r, _file=n, _complete=data.get("complete", True)) for r in data["rows"]]
    return rows


def step_table(rows: list, title: str) -> list[str]:
    if not rows:
        return [f"### {title}", "", "missing (the stage did not run or ended before its first row)", ""]
    ref = next((r for r in rows if r["method"] == "non-private" and "error" not in r), None)
    out = [f"### {title}", "",
           "| method | s/step | x non-private | tokens/s | MFU % | peak GB | x non-private | grad norm | note |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['method']} | failed: {r['error'][:140]} | | | | | | | |")
            continue
        tr = f"{r['time_s'] / ref['time_s']:.2f}" if ref else "n/a"
        mr = f"{r['peak_mb'] / ref['peak_mb']:.2f}" if ref else "n/a"
        mfu = f"{100 * r['mfu']:.1f}" if r.get("mfu") is not None else "n/a"
        note = r.get("note", "")
        if r.get("gram"):
            note += f"; Gram path {r['gram']['taken']}/{r['gram']['asked']} Linear calls"
        if r.get("failed_variants"):
            note += "; failed first: " + " | ".join(x[:100] for x in r["failed_variants"])
        out.append(f"| {r['method']} | {r['time_s']:.3f} | {tr} | {r['tokens_per_s']:,.0f} | {mfu} | "
                   f"{r['peak_mb'] / 1024:.1f} | {mr} | {r['grad_norm']:.4g} | {note.strip('; ')} |")
    return out + [""]


def profile_table(rows: list, title: str) -> list[str]:
    prof = [r for r in rows if r.get("profile")]
    if not prof:
        return []
    out = [f"#### {title}: one profiled step", "",
           "| method | device kernels | launch calls | sync calls | aten ops | wall ms | device busy ms | host gap ms |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in prof:
        p = r["profile"]
        gap = f"{p['host_gap_ms']:.0f}" if p.get("host_gap_ms") is not None else "n/a"
        out.append(f"| {r['method']} | {p['kernels']:,} | {p['launch_calls']:,} | {p['sync_calls']} | "
                   f"{p['aten_ops']:,} | {p['wall_ms']:.0f} | {p['device_busy_ms']:.0f} | {gap} |")
    out.append("")
    for r in prof:
        top = ", ".join(f"{t['name'][:48]} {t['ms']:.1f} ms ({t['count']})" for t in r["profile"]["top"][:8])
        out.append(f"- {r['method']} top items: {top}")
    return out + [""]


def kernels_table(d: str) -> list[str]:
    data = _load(os.path.join(d, "kernels.json"))
    if not data:
        return ["### Kernels against cuBLAS", "", "missing", ""]
    out = ["### Kernels against cuBLAS (" + data.get("device", "?") + ")", "",
           "TFLOP/s (ms); row norms in GB/s (ms)", "",
           "| T x R | p x d | cuBLAS | clipped sum | norms | Gram (both) | row norms |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in data["rows"]:
        cells = []
        for k in ("cublas", "clipped_sum", "norms", "gram", "row_norms"):
            v = r.get(k, {})
            if "error" in v:
                cells.append("failed: " + v["error"][:60])
            elif "tflops" in v:
                cells.append(f"{v['tflops']:.0f} ({v['ms']:.2f})")
            elif "gb_s" in v:
                cells.append(f"{v['gb_s']:.0f} ({v['ms']:.2f})")
            else:
                cells.append("n/a")
        out.append(f"| {r['T']} x {r['R']} | {r['p']} x {r['d']} | " + " | ".join(cells) + " |")
    for r in data["rows"]:
        if "sweep" in r:
            rates = "; ".join(f"{c['config']} chunk {c.get('chunk', 128)}: " + ", ".join(
                f"{n} {c[n]:.0f}" if isinstance(c[n], float) else f"{n} failed" for n in ("clipped_sum", "norms"))
                for c in r["sweep"]["configs"])
            out.append(f"- sweep at T{r['T']}x{r['R']} {r['p']}x{r['d']} (TFLOP/s): {rates}")
    return out + [""]


def massive_table(d: str) -> list[str]:
    out = []
    for policy in ("lowp", "auto"):
        data = _load(os.path.join(d, f"massive-{policy}.json"))
        if not data:
            out += [f"massive activation, Gram {policy}: missing", ""]
            continue
        rows = data["rows"]
        worst = max(rows, key=lambda r: r["ratio"])
        fb = sum(1 for r in rows if r.get("fallbacks"))
        bound = max((r["bound"] or 0.0) for r in rows)
        out.append(f"- massive activation ({data['device']}, Gram {policy}): {len(rows)} cases, largest "
                   f"added/C {worst['ratio']:.7f} ({worst['case']}), cases with an exact fallback {fb}, "
                   f"largest bound share after fallbacks {bound:.1e}")
    return out + [""]


def tests_line(d: str) -> list[str]:
    try:
        with open(os.path.join(d, "tests.log")) as f:
            text = f.read()
    except OSError:
        return ["tests: missing", ""]
    tail = [x for x in text.splitlines() if re.search(r"passed|failed|error|skipped|deselected", x)]
    bad = [x for x in text.splitlines() if x.startswith(("FAILED", "ERROR"))]
    return ["tests: " + (tail[-1] if tail else "no summary line (stopped at its cap?)")] + bad[:20] + [""]


def noise_line(d: str) -> list[str]:
    data = _load(os.path.join(d, "noise.json"))
    if not data:
        return ["noise: missing", ""]
    return ["noise: " + json.dumps(data)[:600], ""]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python benchmarks/gpu_report.py DIR (gpu.sh's WORK folder)")
        return 2
    d = argv[0]
    lines = []
    try:
        with open(os.path.join(d, "env.txt")) as f:
            lines += ["env: " + " / ".join(x.strip() for x in f if x.strip()), ""]
    except OSError:
        lines += ["env: missing", ""]
    shapes = {"T1024x8", "T256x32"} | {f.split("-", 1)[1][:-5] for f in os.listdir(d)
                                        if f.startswith(("clip-", "peers-")) and f.endswith(".json")}
    for shape in sorted(shapes, key=lambda s: -int(s[1:].split("x")[0])):
        rows = _rows(d, f"clip-{shape}", f"peers-{shape}")
        lines += step_table(rows, f"Full fine-tuning, {shape}") + profile_table(rows, shape)
    rows = _rows(d, "lora", "lora-peers")
    lines += step_table(rows, "LoRA r16, T1024x8") + profile_table(rows, "LoRA")
    lines += kernels_table(d)
    grams = sorted(f[:-5] for f in os.listdir(d) if f.startswith("gram-lowp-") and f.endswith(".json"))
    for name in grams or ["gram-lowp-T256x32"]:
        lines += step_table(_rows(d, name), f"The Gram path forced, {name[len('gram-lowp-'):]} (bound share, fallbacks)")
    lines += massive_table(d) + tests_line(d) + noise_line(d)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
