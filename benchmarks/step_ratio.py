"""The DP step's time against the non-private step's, both in one process (issue 50).

    python benchmarks/step_ratio.py                                  # d512, 8 layers, T256 x 8
    python benchmarks/step_ratio.py --hidden 256 --layers 4 --heads 4 --intermediate 688 \\
        --vocab 8192 --seq 64 [--lora]                               # the issue's d256 shape
    python benchmarks/step_ratio.py --family qwen3_moe --hidden 256 --heads 4 --intermediate 688
    python benchmarks/step_ratio.py --profile                        # + where the extra time goes
    python benchmarks/step_ratio.py --lora --variant old:norms.DEFER_ROOT=False \
        --variant new:norms.DEFER_ROOT=True                          # engine settings A/B

One thread. The model and batch of ``benchmarks/clipping.py`` (``build``), its non-private
step (``row_losses(...).sum().backward()``, with the llmdp step's clipper, whose hooks sit
on the same model, not recording: as on a model without one) and its llmdp step
(``GhostClipper.backward``)
alternated ``--steps`` times after a warm-up (``--block K``: K steps of one kind in a row,
the first of each block untimed, as a training loop runs one kind; alternating single steps
makes each step meet the other's allocator state: more page faults, for both), each timed
by the thread's CPU time (less moved by other processes on a shared machine than wall-clock
time, not immune to them); prints the median and the smallest time of each and their ratios,
the median of the ratios of neighbouring steps (or blocks) of the two kinds (the steadiest
of the three on a shared machine whose speed drifts), the exact fallbacks and the largest
bound share. ``--gram`` forces the Linear ghost norms' Gram path (``auto``, ``lowp``,
``float64``: ``clipping/gram.py``). ``--profile``: one more step of each under
torch.profiler after ``--block`` unprofiled steps of its kind (the steady state), each
step's operators' own time against what ran outside them, and the operators (by input
shape) whose CPU time differs most between the two steps. ``benchmarks/clipping.py`` runs
each method in its own process for peak memory.
Both steps run with the objects alive before them frozen (``gc.freeze``), as the worker
loop runs its steps (``llmdp.train.loop.setup_kept``), and under glibc's allocator settings
that llmdp's workers get (``llmdp.base.localray.ALLOCATOR_ENV``: the script starts itself again with them;
``--system-allocator``: glibc's defaults).

``--variant NAME:SETTINGS`` (twice or more) compares engine settings instead: SETTINGS is
``module.NAME=value`` assignments (comma-separated) to modules of ``llmdp.clipping``, a
Python literal each (``engine.WINDOWS=2``). Each of ``--rounds`` rounds runs a block of
``--block`` steps of every variant, in a shuffled order, between two non-private blocks
(each block after one untimed step); a variant's ratio in a round is its block's time over
the mean of the two non-private blocks, and the median and quartiles over rounds are
printed, with those of its time over the first variant's in the same round (the steadier
comparison: a drift of the machine's speed slower than a round moves both alike). Separate
runs of this script differ by more than the few percent one setting moves (BENCHMARKS,
issue 50's fifteenth session).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import clipping as bench  # noqa: E402
import torch  # noqa: E402


def _unrecorded(step, clipper):
    """``step`` as on a model without a clipper: the DP step's clipper, whose hooks sit on
    the same model, records nothing meanwhile (its taps and own forwards off)."""
    def run():
        clipper._recording = False
        try:
            step()
        finally:
            clipper._recording = True
    return run


def _profile(steps: dict, warm: int) -> list[str]:
    """One step of each kind under torch.profiler, after ``warm`` unprofiled steps of the
    same kind (the steady state a training loop runs in: a step profiled right after the
    other kind meets that kind's allocator state, whose page faults then show up as extra
    time in the largest operators, the LM head's and the loss's, though both steps do the
    same work there). Prints each step's time, its aten operators' own CPU time, and the
    difference, what ran outside them (Python: the hooks, the taps' callbacks, the engine's
    bookkeeping; autograd's own work; the profiler's cost per operator), then the operators
    (by input shape) whose own time differs most between the two steps."""
    from torch.profiler import ProfilerActivity, profile

    res, cpu_ms = {}, {}
    for k, (step, reset) in steps.items():
        for _ in range(warm):
            reset()
            step()
        reset()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t0 = time.thread_time()
            step()
            cpu_ms[k] = (time.thread_time() - t0) * 1e3
        res[k] = {(e.key, str(e.input_shapes)): (e.self_cpu_time_total / 1e3, e.count)
                  for e in prof.key_averages(group_by_input_shape=True)}
    keys = set(res["non-private"]) | set(res["llmdp"])

    def diff(k):
        return res["llmdp"].get(k, (0, 0))[0] - res["non-private"].get(k, (0, 0))[0]

    rows = sorted(keys, key=lambda k: -diff(k))
    # aten operators' own time; the rest (Python autograd functions such as the taps, whose
    # own time is their Python, and everything between operators) is outside them
    ops = {k: sum(v[0] for (name, _), v in r.items() if name.startswith("aten::")) for k, r in res.items()}
    out = [f"profiled step after {warm} of its kind, CPU ms: "
           + ", ".join(f"{k} {cpu_ms[k]:.0f} (aten operators {ops[k]:.0f}, outside them {cpu_ms[k] - ops[k]:.0f})"
                       for k in res),
           "   extra ms   llmdp ms/calls   non-private ms/calls  operator  input shapes"]
    for k in rows[:24] + rows[-6:]:
        d, n = res["llmdp"].get(k, (0, 0)), res["non-private"].get(k, (0, 0))
        out.append(f"{diff(k):10.1f}  {d[0]:9.1f}/{d[1]:<5d}  {n[0]:9.1f}/{n[1]:<5d}  {k[0]:28s} {k[1][:90]}")
    return out


def parse_variant(text: str) -> tuple[str, dict[tuple[str, str], object]]:
    """``NAME:module.attr=value,...`` -> (NAME, {(module, attr): value}): modules of
    ``llmdp.clipping``, values Python literals; anything else is refused by name."""
    import ast
    import importlib

    name, sep, settings = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"--variant {text!r}: expected NAME:module.attr=value[,...]")
    out = {}
    for item in filter(None, settings.split(",")):
        target, eq, value = item.partition("=")
        mod, dot, attr = target.strip().rpartition(".")
        if not eq or not dot:
            raise SystemExit(f"--variant {text!r}: {item!r} is not module.attr=value")
        try:
            module = importlib.import_module(f"llmdp.clipping.{mod}")
            literal = ast.literal_eval(value.strip())
        except (ImportError, ValueError, SyntaxError) as e:
            raise SystemExit(f"--variant {text!r}: {item!r}: {e}") from None
        if not hasattr(module, attr):
            raise SystemExit(f"--variant {text!r}: llmdp.clipping.{mod} has no {attr!r}")
        out[(module.__name__, attr)] = literal
    return name, out


def _ab(np_kind, dp_kind, variants: list, rounds: int, block: int, seed: int = 0) -> list[str]:
    """Each variant's median (and quartiles) over ``rounds`` of its block's time over the
    mean of the two non-private blocks around the round (module docstring). A setting that
    a variant does not name has the engine's own value in its blocks, and every setting
    has it again afterwards."""
    import random
    import sys as _sys

    def timed(step, reset) -> float:
        reset()
        step()  # untimed: the block's first step meets the other kind's allocator state
        t0 = time.thread_time()
        for _ in range(block):
            reset()
            step()
        return time.thread_time() - t0

    # every setting a variant does not name is the engine's own value in its blocks
    own = {k: getattr(_sys.modules[k[0]], k[1]) for _, settings in variants for k in settings}

    def apply(settings) -> None:
        for (mod, attr), value in {**own, **settings}.items():
            setattr(_sys.modules[mod], attr, value)

    rng = random.Random(seed)
    ratios: dict = {name: [] for name, _ in variants}
    try:
        for _ in range(rounds):
            order = list(variants)
            rng.shuffle(order)
            t_np = timed(*np_kind)
            got = {}
            for name, settings in order:
                apply(settings)
                got[name] = timed(*dp_kind)
            t_np = (t_np + timed(*np_kind)) / 2
            for name in got:
                ratios[name].append(got[name] / t_np)
    finally:
        apply({})  # the engine's own settings again, also when a step failed
    lines = [f"A/B: {rounds} rounds, blocks of {block} steps, each variant's block against the "
             "non-private blocks around its round"]
    first = variants[0][0]
    for name, settings in variants:
        q = sorted(ratios[name])
        shown = ", ".join(f"{m.rpartition('.')[2]}.{a}={v!r}" for (m, a), v in settings.items())
        # against the first variant in the same round: the steadiest comparison of the two
        vs = sorted(x / y for x, y in zip(ratios[name], ratios[first]))
        lines.append(f"{name:>10s}  ratio median {statistics.median(q):.3f}  quartiles "
                     f"{q[len(q) // 4]:.3f}..{q[(3 * len(q)) // 4]:.3f}; against {first} in its "
                     f"round: median {statistics.median(vs):.3f}, quartiles {vs[len(vs) // 4]:.3f}.."
                     f"{vs[(3 * len(vs)) // 4]:.3f}  ({shown})")
    return lines


def _as_workers_run() -> None:
    """Run this process again with glibc's allocator set as llmdp's Ray workers get it
    (``llmdp.base.localray.ALLOCATOR_ENV``, each key this environment does not set):
    glibc reads it when a process starts, so it cannot be set from here."""
    from llmdp.base.localray import allocator_env

    if missing := allocator_env():
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **missing})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="llama", choices=("llama", *bench.MOE_FAMILIES))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--mode", default="auto", help="llmdp mode: auto, book-keeping, two-pass")
    ap.add_argument("--gram", default="auto", choices=("auto", "lowp", "float64"))
    ap.add_argument("--block", type=int, default=1,
                    help="steps of one kind in a row before switching (the first of each block untimed)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--system-allocator", action="store_true",
                    help="glibc's default allocator settings, not those llmdp's workers get")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:SETTINGS",
                    help="an engine setting to compare, e.g. old:engine.WINDOWS=4 (twice or more)")
    ap.add_argument("--rounds", type=int, default=12, help="--variant: rounds of blocks")
    a = ap.parse_args(argv)
    variants = [parse_variant(v) for v in a.variant]
    if len(variants) == 1:
        raise SystemExit("--variant: give two or more to compare")
    if not a.system_allocator and argv is None:
        _as_workers_run()
    ns = argparse.Namespace(family=a.family, experts=8, top_k=2, hidden=a.hidden, intermediate=a.intermediate,
                            layers=a.layers, heads=a.heads, vocab=a.vocab, seq=a.seq, batch=a.batch,
                            device="cpu", dtype="float32", max_grad_norm=1.0, lora=a.lora, lora_rank=16)
    torch.set_num_threads(1)
    from llmdp.clipping import gram

    model, batch = bench.build(ns)
    np_step, np_reset, _, _ = bench.step_fn("non-private", model, batch, ns)
    dp_step, dp_reset, _, _ = bench.step_fn("llmdp-" + a.mode, model, batch, ns)
    steps = {"non-private": (_unrecorded(np_step, bench._STATS["clipper"]), np_reset),
             "llmdp": (dp_step, dp_reset)}
    times: dict = {k: [] for k in steps}
    from llmdp.train.loop import setup_kept

    if variants:
        with gram.forced(a.gram), setup_kept():
            lines = _ab(steps["non-private"], steps["llmdp"], variants, a.rounds, max(1, a.block))
        print(f"{a.family} d{a.hidden} x {a.layers} layers, vocab {a.vocab}, T{a.seq} x {a.batch}"
              f"{', LoRA r16' if a.lora else ''}; one thread; gram {a.gram}")
        print("\n".join(lines))
        return 0

    # as the worker loop runs its steps: the objects alive now out of the collector's walks
    with gram.forced(a.gram), setup_kept():
        if a.block <= 1:
            for i in range(a.steps + 1):
                for k, (step, reset) in steps.items():
                    reset()
                    t0 = time.thread_time()
                    step()
                    if i:  # the first round warms caches and allocators
                        times[k].append(time.thread_time() - t0)
        else:  # blocks of one kind, as training runs them: the first of each block untimed
            while len(times["llmdp"]) < a.steps:
                for k, (step, reset) in steps.items():
                    for j in range(a.block + 1):
                        reset()
                        t0 = time.thread_time()
                        step()
                        if j:
                            times[k].append(time.thread_time() - t0)
        prof = _profile(steps, max(1, a.block)) if a.profile else []
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    st = getattr(bench._STATS.get("clipper"), "last_norm_stats", None)
    print(f"{a.family} d{a.hidden} x {a.layers} layers, vocab {a.vocab}, T{a.seq} x {a.batch}"
          f"{', LoRA r16' if a.lora else ''}; one thread; {len(times['llmdp'])} steps"
          f"{f' in blocks of {a.block}' if a.block > 1 else ''}; gram {a.gram}")
    print(f"non-private s/step median {med['non-private']:.3f} min {low['non-private']:.3f}; "
          f"llmdp median {med['llmdp']:.3f} min {low['llmdp']:.3f}")
    # each step (or block) against its neighbour of the other kind: a drift of the machine's
    # speed, slower than a step or block, moves both alike (the steadier figure on a shared VM)
    b = max(1, a.block)
    nb_ = len(times["llmdp"]) // b
    paired = statistics.median(statistics.fmean(times["llmdp"][i * b:(i + 1) * b])
                               / statistics.fmean(times["non-private"][i * b:(i + 1) * b]) for i in range(nb_))
    print(f"paired ratio median {paired:.3f} over {nb_} {'blocks' if b > 1 else 'steps'}")
    print(f"ratio median {med['llmdp'] / med['non-private']:.3f}, min {low['llmdp'] / low['non-private']:.3f}; "
          f"exact fallbacks {getattr(st, 'fallbacks', None)}, largest bound share "
          f"{getattr(st, 'bound_max', float('nan')):.2e}")
    for line in prof:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
