"""The benchmark scripts run (small sizes; timings are reported, never asserted)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from tests.helpers import run_interpreted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name: str):
    """A benchmark script as a module (benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _clipping():
    """benchmarks/clipping.py, its per-method processes forked from the tests' forkserver
    (``tests.helpers.ForkedScripts``: the same script run as ``__main__``, without a fresh
    interpreter's ~3.5 CPU-s of imports each)."""
    from tests.helpers import ForkedScripts

    module = _script("clipping")
    module.subprocess = ForkedScripts
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


# benchmarks/clipping.py on a tiny Llama: every method runs in its own process (forked here,
# `_clipping`), so these tests run few methods and one timed step.
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
    main = _clipping().main
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
    assert _clipping().main(_tiny_argv(
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
    assert "n/a" in next(x for x in table.splitlines() if x.startswith("non-private "))


def test_clipping_benchmark_opake_rows_match_llmdp(tmp_path):
    """Where Opake is installed, its rows compute llmdp's clipped sum (LoRA, tiny model)."""
    pytest.importorskip("opake.api.engine.clipping")
    out = tmp_path / "opake.json"
    assert _clipping().main(_tiny_argv(
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


def test_checkpoint_benchmark_runs_small(tmp_path, capsys, monkeypatch):
    """benchmarks/checkpoint.py on a tiny Llama, 1 and 2 gloo processes (forked from the
    tests' forkserver instead of spawned: the script's worker function, the same program);
    every (world size, path) row is there and consistent."""
    import torch.multiprocessing as mp

    from tests.helpers import in_script, start_processes

    path = os.path.join(ROOT, "benchmarks", "checkpoint.py")

    spawn = mp.start_processes

    def forked(fn, args=(), nprocs=1, join=True, start_method="spawn"):
        if start_method != "spawn":  # start_processes' own call, from the forkserver
            return spawn(fn, args=args, nprocs=nprocs, join=join, start_method=start_method)
        assert join
        start_processes(in_script, (path, fn.__name__, *args), nprocs)

    monkeypatch.setattr(mp, "start_processes", forked)
    out = tmp_path / "rows.json"
    argv = ["--hidden", "32", "--intermediate", "64", "--layers", "2", "--heads", "2", "--vocab", "128",
            "--worlds", "1,2", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)]
    assert _script("checkpoint").main(argv) == 0
    stdout = capsys.readouterr().out
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
    assert "| 2 | dcp |" in stdout and "dcp ÷ full" in stdout


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
    assert "profiled step after 1 of its kind" in out and "outside them" in out
    assert "paired ratio median" in out and "over 1 steps" in out
    # blocks of one kind: 4 timed steps of each in blocks of 2 (a first untimed in each)
    assert main(["--hidden", "32", "--layers", "1", "--heads", "2", "--intermediate", "48",
                 "--vocab", "64", "--seq", "8", "--batch", "2", "--steps", "4", "--block", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 steps in blocks of 2" in out and "over 2 blocks" in out
    # engine settings compared in one process
    assert main(["--hidden", "32", "--layers", "1", "--heads", "2", "--intermediate", "48",
                 "--vocab", "64", "--seq", "8", "--batch", "2", "--rounds", "1",
                 "--variant", "old:norms.DEFER_ROOT=False", "--variant", "new:norms.DEFER_ROOT=True"]) == 0
    out = capsys.readouterr().out
    assert "A/B: 1 rounds, blocks of 1 steps" in out and "old  ratio median" in out and "new  ratio" in out
    with pytest.raises(SystemExit, match="two or more"):
        main(["--variant", "old:norms.DEFER_ROOT=False"])


def test_step_ratios_profile_takes_a_step_after_steps_of_its_own_kind():
    """--profile profiles each kind's step after ``warm`` unprofiled steps of that kind (the
    steady state), never right after the other kind (whose allocator state would show as
    extra time in the largest operators); each step reset before it runs."""
    import torch

    mod = _script("step_ratio")
    seen = []

    def kind(name):
        def step():
            seen.append((name, torch.autograd.profiler._is_profiler_enabled))
            torch.ones(4).sum()
        return step, lambda: seen.append(("reset", False))

    out = mod._profile({"non-private": kind("np"), "llmdp": kind("dp")}, warm=2)
    runs = [s for s in seen if s[0] != "reset"]
    assert runs == [("np", False), ("np", False), ("np", True), ("dp", False), ("dp", False), ("dp", True)]
    assert len(seen) == 2 * len(runs)  # a reset before every step
    assert out[0].startswith("profiled step after 2 of its kind") and "outside them" in out[0]


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


def test_clipping_benchmark_falls_back_to_fewer_kernels_and_counts_the_gram_path(tmp_path, capsys, monkeypatch):
    """benchmarks/gpu.sh's safety net: an llmdp row whose variant fails is run again with the
    next variant (fewer of the engine's newest kernels), and the row says which one ran and
    why the others failed; the variants compute the same clipped sum. ``--gram lowp`` sends
    every Linear call to the Gram path (the row counts them), and the profiled step's counts
    come back in the row."""
    clip = _clipping()
    out = tmp_path / "fallback.json"
    monkeypatch.setenv("LLMDP_BENCH_FAIL_VARIANTS", "default,no-gram-rownorm")
    # --gram lowp asked, but the fallback variant leaves the Gram path out: the variant wins
    assert clip.main(_tiny_argv(methods="llmdp-auto", json=out, profile=tmp_path / "prof") + ["--gram", "lowp"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row and row["variant"] == "no-triton", row
    assert [f.split(":")[0] for f in row["failed_variants"]] == ["default", "no-gram-rownorm"]
    assert "variant no-triton" in row["note"] and "llmdp-auto: " in capsys.readouterr().out
    assert row["gram"]["asked"] > 0 and row["gram"]["taken"] == 0  # the variant has no Gram path
    prof = row["profile"]
    assert prof["aten_ops"] > 0 and prof["kernels"] == 0 and prof["host_gap_ms"] is None
    assert prof["top"] and (tmp_path / "prof" / "profile-llmdp-auto.txt").exists()

    monkeypatch.setenv("LLMDP_BENCH_FAIL_VARIANTS", "")
    forced = tmp_path / "lowp.json"
    assert clip.main(_tiny_argv(methods="llmdp-auto", json=forced) + ["--gram", "lowp"]) == 0
    (lowp_row,) = json.loads(forced.read_text())["rows"]
    assert lowp_row["variant"] == "default" and "failed_variants" not in lowp_row
    assert lowp_row["gram"]["taken"] == lowp_row["gram"]["asked"] > 0
    assert lowp_row["fallbacks"] == 0 and 0 < lowp_row["bound_max"] < 0.01
    assert lowp_row["grad_norm"] == pytest.approx(row["grad_norm"], rel=1e-5)

    monkeypatch.setenv("LLMDP_BENCH_FAIL_VARIANTS", ",".join(clip.VARIANTS))
    none = tmp_path / "none.json"
    assert clip.main(_tiny_argv(methods="llmdp-auto", json=none) + ["--no-fallback"]) == 0
    (failed,) = json.loads(none.read_text())["rows"]
    assert "variant default failed" in failed["error"] and "failed_variants" not in failed


def test_clipping_benchmark_method_timeout_ends_one_row_not_the_run(tmp_path):
    clip = _script("clipping")  # a fresh interpreter: a forked one finishes inside the timeout
    out = tmp_path / "timeout.json"
    assert clip.main(_tiny_argv(methods="non-private", json=out) + ["--method-timeout", "0.2"]) == 0
    data = json.loads(out.read_text())
    assert data["complete"] and data["rows"][0]["error"].startswith("timed out after 0.2 s")


class _Interval:
    def __init__(self, us):
        self.us = us

    def elapsed_us(self):
        return self.us


class _Ev:
    """torch.profiler's FunctionEvent, what profile_counts reads of it."""

    def __init__(self, name, device=False, t=0.0, parent=None):
        self.name, self.time_range, self.cpu_parent = name, _Interval(t), parent
        self.device_type = "DeviceType.CUDA" if device else "DeviceType.CPU"
        self.self_cpu_time_total = 0.0


def test_profile_counts_kernels_launches_syncs_and_the_host_gap():
    """What a profiled CUDA step issued, from its events: device events are kernels and
    busy time; runtime calls split into launches and syncs (the benchmark's own closing
    sync not counted); an aten operator called by another counts once, in its caller."""
    counts = _script("clipping").profile_counts
    mm = _Ev("aten::mm")
    events = [mm, _Ev("aten::t", parent=mm), _Ev("aten::mul"), _Ev("aten::item"),
              _Ev("aten::_local_scalar_dense", parent=_Ev("aten::item")),
              _Ev("cudaLaunchKernel"), _Ev("cuLaunchKernelEx"), _Ev("cudaLaunchKernel"),
              _Ev("cudaStreamSynchronize"), _Ev("cudaDeviceSynchronize"), _Ev("cudaMemcpyAsync"),
              _Ev("sm90_gemm", device=True, t=3000.0), _Ev("mul_kernel", device=True, t=500.0),
              _Ev("mul_kernel", device=True, t=500.0)]
    c = counts(events, wall_s=0.010, explicit_syncs=1)
    assert c["kernels"] == 3 and c["launch_calls"] == 3 and c["sync_calls"] == 1
    assert c["aten_ops"] == 3  # mm, mul, item; not the mm's t or the item's scalar read
    assert c["device_busy_ms"] == pytest.approx(4.0) and c["host_gap_ms"] == pytest.approx(6.0)
    assert c["top"][0] == {"name": "sm90_gemm", "ms": 3.0, "count": 1}
    assert c["top"][1] == {"name": "mul_kernel", "ms": 1.0, "count": 2}
    assert c["runtime_calls"]["cudaMemcpyAsync"] == 1


def test_gpu_report_tables_from_a_runs_json(tmp_path, capsys):
    """benchmarks/gpu_report.py: ratios against the same shape's non-private row across the
    stage's two calls, failed rows and missing stages said, the profile's counts shown."""
    prof = {"kernels": 9000, "launch_calls": 8800, "sync_calls": 2, "aten_ops": 7000, "wall_ms": 500.0,
            "device_busy_ms": 400.0, "host_gap_ms": 100.0, "top": [{"name": "k", "ms": 50.0, "count": 3}]}

    def row(method, t, peak, **kw):
        return {"method": method, "time_s": t, "peak_mb": peak, "tokens_per_s": 8192 / t, "mfu": 0.3,
                "grad_norm": 2.82, "note": "", **kw}
    (tmp_path / "clip-T1024x8.json").write_text(json.dumps({"rows": [
        row("non-private", 0.2, 1024.0, profile=prof), row("llmdp-auto", 0.3, 1331.2, gram={"asked": 10, "taken": 4})]}))
    (tmp_path / "peers-T1024x8.json").write_text(json.dumps({"rows": [
        row("opacus-ghost", 0.4, 1024.0), {"method": "opake-whole-batch", "error": "step failed: OutOfMemoryError"}],
        "complete": False}))
    (tmp_path / "tests.log").write_text("....\n80 passed in 123.45s\n")
    assert _script("gpu_report").main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| llmdp-auto | 0.300 | 1.50 |" in out and "| 1.30 |" in out
    assert "Gram path 4/10 Linear calls" in out
    assert "| opacus-ghost | 0.400 | 2.00 |" in out
    assert "| opake-whole-batch | failed: step failed: OutOfMemoryError |" in out
    assert "| non-private | 9,000 | 8,800 | 2 | 7,000 | 500 | 400 | 100 |" in out
    assert "### Full fine-tuning, T256x32\n\nmissing" in out
    assert "tests: 80 passed in 123.45s" in out and "noise: missing" in out


def test_kernels_benchmark_dry_run_times_every_kernel_in_the_interpreter(tmp_path):
    """benchmarks/kernels.py --dry-run (the GPU script's rehearsal): every kernel of a
    layer runs in Triton's interpreter on CPU tensors and is timed; none fails."""
    pytest.importorskip("triton")

    out = tmp_path / "k.json"
    code = ("import sys; sys.argv[0] = 'kernels'; import benchmarks.kernels as k; "
            "k.DRY_SHAPES = [(40, 24)]; k.DRY_GRIDS = [(130, 2)]; "
            "k.CONFIGS = [(128, ((16, 32, 128), 4, 1)), (64, ((16, 32, 64), 4, 1))]; "
            f"raise SystemExit(k.main(['--dry-run', '--sweep', '--json', {str(out)!r}]))")
    proc = run_interpreted(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (r,) = json.loads(out.read_text())["rows"]
    assert (r["T"], r["R"], r["p"], r["d"]) == (130, 2, 40, 24)
    for kind in ("cublas", "clipped_sum", "norms", "gram", "row_norms"):
        assert "error" not in r[kind] and r[kind]["ms"] > 0, (kind, r[kind])
    # each config's results checked against the default's, then timed: a chunk of 128 and of 64
    swept = r["sweep"]["configs"]
    assert [(c["chunk"], c["config"]) for c in swept] == [(128, [[16, 32, 128], 4, 1]), (64, [[16, 32, 64], 4, 1])]
    for c in swept:
        assert isinstance(c["clipped_sum"], float) and isinstance(c["norms"], float), c


def test_privacy_utility_tuned_runs_tune_at_zero_epsilon_per_epsilon_first(capsys):
    """Issue 54 item 5: --tuned runs, before any private run, one zero-ε sweep per ε of the
    demo's tuning recipe with that ε's noise simulated, each writing its file, and every DP
    run takes its own ε's file; NON-PRIVATE is the former recipe's (AdamW), which, like the
    former recipe's table (no --tuned), drops the demo's committed selection (or it would be
    refused)."""
    mod = _script("privacy_utility")
    assert mod.main(["--tuned", "--dry-run", "--seeds", "0,1", "--epsilons", "1,8", "--out-dir", "x"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    sweeps = [c for c in lines if c[1] == "sweep"]
    trains = [c for c in lines if c[1] == "train" and "recipes/demo-finetune.yaml" in c]
    assert len(sweeps) == 2 and len(trains) == 2 * 3
    assert lines.index(sweeps[-1]) < lines.index(trains[0])

    def eps_of(c):
        return next((a.split("=")[1] for a in c if a.startswith("privacy.target_epsilon=")), None)

    by_eps = {}
    for c in sweeps:
        assert "recipes/demo-tune.yaml" in c and "eval.epsilon=null" in c
        by_eps[eps_of(c)] = c[c.index("--write-best") + 1]
    assert set(by_eps) == {"1", "8"}
    for c in trains:
        if eps_of(c) is None:
            assert "privacy.dp=false" in c and "optim.name=adamw" in c
            assert "train.hyperparameters_from=null" in c
        else:
            assert f"train.hyperparameters_from={by_eps[eps_of(c)]}" in c
            assert not any(a.startswith(("optim.", "privacy.mechanism")) for a in c)
    old = mod.runs([0], [8.0], starts=("pretrained",))
    assert all("train.hyperparameters_from=null" in over and "optim.lr=0.003" in over
               for _, _, over in old)


def test_step_ratio_ab_runs_each_variant_with_its_own_settings_only(monkeypatch):
    """--variant: every round runs each variant's block (shuffled) between two non-private
    blocks, with that variant's settings and the engine's own value of every setting it does
    not name; the engine's settings are its own again afterwards; a bad setting is refused
    by name."""
    from llmdp.clipping import engine, norms

    mod = _script("step_ratio")
    seen = []

    def kind(name):
        def step():
            seen.append((name, norms.DEFER_ROOT, engine.WINDOWS))
        return step, lambda: None

    own = (norms.DEFER_ROOT, engine.WINDOWS)
    variants = [mod.parse_variant("a:norms.DEFER_ROOT=False"), mod.parse_variant("b:engine.WINDOWS=2")]
    assert variants[1] == ("b", {("llmdp.clipping.engine", "WINDOWS"): 2})
    lines = mod._ab(kind("np"), kind("dp"), variants, rounds=3, block=2)
    assert (norms.DEFER_ROOT, engine.WINDOWS) == own
    rounds = [seen[i:i + 12] for i in range(0, len(seen), 12)]
    assert len(rounds) == 3 and len(seen) == 36  # 4 blocks of 1 untimed + 2 timed steps
    for r in rounds:
        assert [s[0] for s in r] == ["np"] * 3 + ["dp"] * 6 + ["np"] * 3
        settings = {r[3][1:], r[6][1:]}
        assert settings == {(False, own[1]), (own[0], 2)}  # each variant's own, the rest the engine's
    assert "a  ratio median" in lines[1] and "(norms.DEFER_ROOT=False)" in lines[1]
    assert "against a in its round: median 1.000" in lines[1] and "against a in its round" in lines[2]
    assert "(engine.WINDOWS=2)" in lines[2]
    for bad, why in [("x", "expected NAME:"), ("x:norms.NOPE=1", "has no 'NOPE'"),
                     ("x:norms.DEFER_ROOT=maybe", "malformed"), ("x:nomod.A=1", "No module")]:
        with pytest.raises(SystemExit, match=why):
            mod.parse_variant(bad)
