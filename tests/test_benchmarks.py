"""The benchmark scripts run (small sizes; timings are reported, never asserted)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name: str):
    """A benchmark script as a module (benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("sampler", ["poisson", "truncated-poisson"])
def test_sampling_benchmark_runs_small(tmp_path, capsys, sampler):
    main = _script("sampling").main
    assert main(["--units", "20000", "--batch", "200", "--workers", "3", "--physical", "16",
                 "--repeats", "1", "--sampler", sampler, "--dir", str(tmp_path / "store")]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["units"] == 20000 and 20000 < lines[0]["rows"] < 3 * 20000
    reps = [x for x in lines if "rep" in x]
    for r in reps:
        # every sampled unit's rows were read, and all of them are real tokens' rows
        assert r["sampled_units"] > 0 and r["rows"] >= r["sampled_units"]
        if sampler == "truncated-poisson":
            assert r["sampled_units"] <= int(200 + 4 * 200 ** 0.5)
    assert lines[-1]["N"] == 20000 and lines[-1]["total_s"] > 0


def test_sampling_benchmark_draw_only_runs_small(capsys):
    main = _script("sampling").main
    assert main(["--draw-only", "--draw-units", "1000000", "--draw-batch", "1000",
                 "--reference-units", "100000", "--repeats", "2"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    runs = {x["run"]: x for x in lines if "run" in x}
    assert runs["poisson_large_n"]["N"] == 1000000 and runs["reference_small_n"]["N"] == 100000
    assert all(r["median_s"] > 0 and r["peak_bytes"] > 0 for r in runs.values())
    assert lines[-1]["reference_over_poisson_s_at_small_n"] > 0


# benchmarks/clipping.py on a tiny Llama: every method runs in its own subprocess (~5 s of
# imports each), so these tests run few methods and one timed step.
TINY = dict(hidden=32, intermediate=64, layers=2, heads=2, vocab=128, seq=16, batch=4)


def _tiny_argv(**extra) -> list[str]:
    argv = []
    for key, value in {**TINY, "steps": 1, "threads": 1, **extra}.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


def _tiny_counts(rank: int) -> tuple[int, int, int]:
    """(P, P_lora, all parameters of the full model) of TINY, from its shapes alone: P =
    the non-embedding parameters plus the LM head (untied, no biases, as many KV heads as
    heads); P_lora = rank·(fan-in + fan-out) over the 7 projections of every layer."""
    h, i, L, V = TINY["hidden"], TINY["intermediate"], TINY["layers"], TINY["vocab"]
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # q k v o, gate up down, two RMSNorms
    P = L * per_layer + h + V * h  # + final norm + LM head
    lora = L * rank * (4 * (h + h) + 2 * (h + i) + (i + h))
    return P, lora, P + V * h


def test_clipping_benchmark_peak_table():
    peak = _script("clipping").device_peak_tflops
    assert peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989
    assert peak("NVIDIA H100 PCIe", "float16") == 756
    assert peak("NVIDIA H200", "bfloat16") == 989
    assert peak("NVIDIA A100-SXM4-80GB", "bfloat16") == 312
    assert peak("NVIDIA H100 80GB HBM3", "float32") == 67
    assert peak("NVIDIA A100-SXM4-40GB", "float32") == 19.5
    assert peak("NVIDIA H100 NVL", "bfloat16") is None  # not in the table: --peak-tflops
    assert peak("NVIDIA GeForce RTX 4090", "bfloat16") is None
    assert peak("NVIDIA H100 80GB HBM3", "float64") is None


def test_clipping_benchmark_lora_reports_throughput_and_mfu(tmp_path, capsys):
    main = _script("clipping").main
    rank, peak = 2, 0.5
    out = tmp_path / "lora.json"
    assert main(_tiny_argv(lora_rank=rank, peak_tflops=peak, methods="non-private,llmdp-auto",
                           json=out) + ["--lora"]) == 0
    table = capsys.readouterr().out
    assert "tokens/s" in table and "MFU %" in table and "LoRA r=2" in table
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"non-private", "llmdp-auto"}
    P, P_lora, full = _tiny_counts(rank)
    B, T, L, d = TINY["batch"], TINY["seq"], TINY["layers"], TINY["hidden"]
    N = B * T
    # LoRA: frozen weights cost forward + input gradient (4·P·N), the adapters 6·P_lora·N.
    flops = 4 * P * N + 6 * P_lora * N + 12 * L * d * T * N
    for r in rows.values():
        assert "error" not in r, r
        assert r["params"] == P_lora and r["params"] < full / 10  # adapters only
        assert r["total_params"] == full + P_lora
        assert r["tokens"] == N and r["flops"] == flops
        assert r["tokens_per_s"] == pytest.approx(N / r["time_s"], rel=1e-9)
        assert r["peak_tflops"] == peak
        assert r["mfu"] == pytest.approx(flops / r["time_s"] / (peak * 1e12), rel=1e-9)
        assert f"{100 * r['mfu']:.2f}" in table
    assert rows["llmdp-auto"]["grad_norm"] > 0


def test_clipping_benchmark_full_flops_and_missing_opake(tmp_path, capsys, monkeypatch):
    """Full fine-tuning uses 6·P·N; opake rows without opake say so and the run goes on."""
    shadow = tmp_path / "shadow" / "opake"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("hidden by the test", name="opake")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(shadow.parent), ROOT, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "full.json"
    assert _script("clipping").main(_tiny_argv(
        methods="opake-whole-batch,non-private,opake-microbatch", json=out)) == 0
    table = capsys.readouterr().out
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    for m in ("opake-whole-batch", "opake-microbatch"):
        assert rows[m] == {"method": m, "error": "opake not installed (pip install llmdp[bench])"}
        assert f"{m:<20}  opake not installed (pip install llmdp[bench])" in table
    r = rows["non-private"]
    P, _, full = _tiny_counts(0)
    B, T, L, d = TINY["batch"], TINY["seq"], TINY["layers"], TINY["hidden"]
    assert r["params"] == r["total_params"] == full
    assert r["flops"] == 6 * P * B * T + 12 * L * d * T * B * T
    # on CPU with no --peak-tflops: no MFU, and the table says n/a
    assert r["mfu"] is None and r["peak_tflops"] is None
    assert "n/a" in table.split("non-private", 1)[1].splitlines()[0]


def test_clipping_benchmark_opake_rows_match_llmdp(tmp_path):
    """Where Opake is installed, its rows compute llmdp's clipped sum (LoRA, tiny model)."""
    pytest.importorskip("opake.api.engine.clipping")
    out = tmp_path / "opake.json"
    assert _script("clipping").main(_tiny_argv(
        lora_rank=2, methods="llmdp-auto,opake-whole-batch,opake-microbatch", json=out)
        + ["--lora"]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert all("error" not in r for r in rows.values()), rows
    ref = rows["llmdp-auto"]["grad_norm"]
    for m in ("opake-whole-batch", "opake-microbatch"):
        assert rows[m]["grad_norm"] == pytest.approx(ref, rel=1e-4)


def test_contractions_benchmark_runs_small_on_cpu(capsys):
    """benchmarks/contractions.py: every contraction of a layer is timed and printed as a
    ratio to the non-private weight-gradient GEMM (tiny shapes here; the GPU run is in
    BENCHMARKS.md)."""
    _script("contractions").main(["--device", "cpu", "--dtype", "bfloat16", "--small", "--reps", "1"])
    out = capsys.readouterr().out
    for layer in ("attn q/o", "mlp up/gate", "mlp down", "lm head"):
        line = next(ln for ln in out.splitlines() if ln.startswith(layer))
        assert line.count("x)") == 3, line


def test_checkpoint_benchmark_runs_small(tmp_path):
    """benchmarks/checkpoint.py on a tiny Llama, 1 and 2 gloo processes (a script run: its
    workers are spawned from it); every (world size, path) row is there and consistent."""
    import subprocess
    import sys

    out = tmp_path / "rows.json"
    argv = [sys.executable, os.path.join(ROOT, "benchmarks", "checkpoint.py"), "--hidden", "32",
            "--intermediate", "64", "--layers", "2", "--heads", "2", "--vocab", "128",
            "--worlds", "1,2", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.load(open(out))
    assert sorted((r["world"], r["path"]) for r in rows) == [(1, "dcp"), (1, "full"), (2, "dcp"), (2, "full")]
    h, i, L, V = 32, 64, 2, 128
    params = 2 * V * h + L * (4 * h * h + 3 * h * i + 2 * h) + h
    for r in rows:
        assert r["params"] == params and r["state_bytes"] == 12 * params
        assert r["rank0_bytes_written"] > 0 and r["measured_by"] in ("VmHWM", "sampled VmRSS")
    # Rank 0 writes the whole state on the full path; only its shards (and the index) on dcp.
    full2 = next(r for r in rows if r["world"] == 2 and r["path"] == "full")
    assert full2["rank0_bytes_written"] > full2["state_bytes"]
    assert "| 2 | dcp |" in done.stdout and "dcp ÷ full" in done.stdout


def test_checkpoint_benchmark_table_ratios():
    table = _script("checkpoint").table
    rows = [{"world": w, "path": p, "rank0_peak_increase_bytes": b, "seconds": 1.0,
             "rank0_bytes_written": b, "state_bytes": 1200 * 2**20}
            for w, p, b in [(1, "full", 1200 * 2**20), (1, "dcp", 600 * 2**20), (2, "full", 1200 * 2**20),
                            (2, "dcp", 300 * 2**20), (2, "dcp", 100 * 2**20)]]
    text = table(rows)
    assert "| 2 | dcp | 300.0 | 0.250 | 0.50 | 300 | 1.00 |" in text  # the larger of two repeats
    assert "| 1 | full | 1200.0 | 1.000 | 1.00 |" in text
    assert "| 2 | 0.250 |" in text and "| 1 | 0.500 |" in text
    zero = [dict(r, rank0_peak_increase_bytes=0) if r["world"] == 1 else r for r in rows]
    assert "| 1 | 0.0 |" not in table(zero) and "| 1 | — |" in table(zero)  # no division by zero


def test_noise_benchmark_counts_sass_opcodes_in_both_listing_forms():
    """The first GPU run's instruction mix read 0 instructions: Triton 3.6 lists SASS with a
    control-code column, not cuobjdump's /*offset*/ form. Both forms are counted, predicates
    and modifiers dropped."""
    mod = _script("noise")
    triton_form = ("Function:gauss_add_kernel\n--:-:0:-:8\tLDC R1, c[0x0][0x28];\n"
                   "01:-:-:Y:6\t@!P0 IMAD.IADD R1, R1, 0x1;\n--:-:-:-:1\tLOP3.LUT R2, R3, R4, R5, 0x96, !PT;\n")
    assert mod.sass_opcodes(triton_form) == ["LDC", "IMAD", "LOP3"]
    cuobjdump_form = ("        /*0040*/                   @P0 SHF.L.W.U32.HI R1, R2, 0x10, R2 ;\n"
                      "        /*0050*/                   DFMA R4, R6, R8, R4 ;\n")
    assert mod.sass_opcodes(cuobjdump_form) == ["SHF", "DFMA"]
    assert mod.sass_opcodes("no listing here") == []


def test_step_ratio_benchmark_runs_small(capsys):
    """benchmarks/step_ratio.py: both steps in one process, ratios printed, the profile's
    table of extra operators (a tiny model; the ratio itself is never asserted)."""
    main = _script("step_ratio").main
    assert main(["--hidden", "32", "--layers", "1", "--heads", "2", "--intermediate", "48",
                 "--vocab", "64", "--seq", "8", "--batch", "2", "--steps", "1", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "ratio median" in out and "exact fallbacks 0" in out and "extra ms" in out
    assert "paired ratio median" in out and "over 1 steps" in out
    # blocks of one kind: 4 timed steps of each in blocks of 2 (a first untimed in each)
    assert main(["--hidden", "32", "--layers", "1", "--heads", "2", "--intermediate", "48",
                 "--vocab", "64", "--seq", "8", "--batch", "2", "--steps", "4", "--block", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 steps in blocks of 2" in out and "over 2 blocks" in out


def test_step_ratios_non_private_step_records_nothing_on_the_dp_clippers_hooks():
    """The DP step's clipper sits on the same model: during the non-private step it records
    no call (no taps, no own forward: a baseline without a clipper), and records again
    afterwards, also when the step fails."""
    from llmdp.clipping import GhostClipper

    unrecorded = _script("step_ratio")._unrecorded
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).double()
    clipper = GhostClipper(model, 1.0)
    seen = []

    def step():
        out = model(torch.ones(4, 3, dtype=torch.float64))
        seen.append((clipper._recording, type(out.grad_fn).__name__))
        out.sum().backward()

    unrecorded(step, clipper)()
    assert seen == [(False, "AddmmBackward0")] and clipper._recording  # no tap on the output
    step()
    assert seen[-1] == (True, "_TapBackward")

    def failing():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        unrecorded(failing, clipper)()
    assert clipper._recording


def test_launches_at_16_layers_are_within_issue_50_targets(tmp_path):
    """benchmarks/launches.py with the CUDA path emulated (the counts do not depend on the
    widths: small ones here), 16 Llama layers, T64 x 8, book-keeping: one step's launches
    within issue 50's targets, LoRA r16 on all seven projections <= 4,500 and full
    fine-tuning <= 3,000, with at most 9 host syncs each. A change that adds launches per
    call, per layer or per window read fails here."""
    main = _script("launches").main
    out = tmp_path / "launches.json"
    assert main(["--emulate-cuda", "--layers", "16", "--hidden", "64", "--intermediate", "172",
                 "--vocab", "512", "--configs", "lora,full", "--methods", "llmdp-book-keeping",
                 "--threads", "1", "--json", str(out)]) == 0
    rows = {("lora" if r["lora"] else "full"): r["total"] for r in json.loads(out.read_text())["rows"]}
    assert rows["lora"]["launches"] <= 4500, rows["lora"]
    assert rows["full"]["launches"] <= 3000, rows["full"]
    assert all(r["syncs"] + r["implicit_syncs"] <= 9 for r in rows.values()), rows
