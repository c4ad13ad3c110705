"""The benchmark scripts run (small sizes; timings are reported, never asserted)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

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
