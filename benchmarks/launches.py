r"""What one DP step issues: device launches, host syncs, GEMM FLOPs and bytes, by phase.

    python benchmarks/launches.py                    # d256, 4 layers, T64x8: full and LoRA, CPU
    python benchmarks/launches.py --emulate-cuda     # the CUDA bf16 path, emulated on the CPU
    python benchmarks/launches.py --emulate-cuda --hidden 2048 --layers 16 --heads 32 \
        --intermediate 8192 --vocab 128256 --seq 1024 --batch 8      # the 16-layer bench shape
    python benchmarks/launches.py --json out.json --methods non-private,llmdp-book-keeping

A host-side count, no timing: every aten operator dispatched while one step runs (under a
``TorchDispatchMode``), each counted as one launch unless it is a view or an allocation
without a fill (``VIEWS``: they launch nothing on a GPU). A step is the forward pass and
the backward that leaves the step's gradient in the sinks: the plain ``backward()`` for
``non-private``, ``GhostClipper.backward`` for ``llmdp-*`` (the optimizer and the noise are
the same for both and not counted). One warm-up step runs first, uncounted.

Phases: ``forward`` (the model and the loss), ``backward`` (inside the autograd passes:
for llmdp, the per-call norms its taps take as G arrives, and two-pass's second pass),
``after`` (everything else in ``GhostClipper.backward``: the few operators before its
first pass, then the deferred checks, the norms, factors and the clipped sum after it).

Host syncs (a GPU step waits for the device at each): ``syncs`` are the explicit ones,
``_local_scalar_dense`` (``item``, ``bool``, ``float``, ``int`` of a tensor), ``nonzero``,
``equal``, ``is_nonzero`` (the kinds tests/clipping count); ``implicit`` the others:
``Tensor.tolist`` (counted by a wrapper: on the CPU it dispatches nothing) and the
operators whose CUDA kernels read a size back (indexing or ``index_put_`` with a boolean
mask, ``masked_select``, ``bincount``, ``unique``, ``repeat_interleave`` without
``output_size``). A ``tolist`` right after a ``nonzero`` waits for nothing new but is
counted.

GEMM FLOPs (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``addbmm``, attention kernels, the
emulated contractions) are 2·m·n·k, keyed by the operands' dtype; bytes are the sizes of
every launching operator's tensor inputs and outputs (a traffic estimate: an operator that
reads a tensor twice counts it once; a fused kernel counts its operands once).

``--emulate-cuda``: the model in ``--dtype`` (default bfloat16) with SDPA attention, and
the engine's CUDA branches taken on the CPU (``llmdp.clipping.lowp``): ``tensor_cores``
and the Triton path are on for half-precision operands of one dtype; each tensor-core
``bmm(out_dtype=float32)`` chunk and each launch of a Triton kernel of
``_triton_rowscaled`` (the clipped sum, the per-unit norms; needs Triton importable) is
replaced by a stand-in that computes the same quantity in float32 or float64 and counts as
ONE launch (its GEMM FLOPs keyed ``bfloat16``/``float16``), while the kernels' wrappers run
as they do on a GPU (their torch operations counted: the factors' cast, the sums of
partial results; an H200's 132 SMs decide the wrappers' split of the rows); the
half-precision row norms take their one-reduction CUDA branch; the layer choice sees an
H200 (``norms.device_spec``) and ``mode="auto"`` 140 GB of free memory. Values differ from
a GPU's by rounding only; the counts are the GPU's (the H200 profile of the 16-layer model
matched them: mul 3,243 vs 3,244, mm 226 vs 226, linalg_vector_norm 212 vs 212).
The CPU's own sdpa kernel is one operator forward and one backward, as flash attention is.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

METHODS = ("non-private", "llmdp-book-keeping", "llmdp-two-pass", "llmdp-auto")
DEFAULT_METHODS = METHODS[:3]  # auto resolves to one of the other two (its row says which)

SYNCS = ("_local_scalar_dense", "nonzero", "equal", "is_nonzero", "item")  # the explicit ones
_SYNC_ALWAYS = {*SYNCS, "masked_select", "bincount", "_unique", "_unique2", "unique_dim",
                "unique_consecutive", "argwhere"}
_NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
              "detach", "alias", "_to_copy_noop", "set_", "resize_", "_reshape_alias", "sym_size",
              "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"}
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
          "_scaled_dot_product_flash_attention_for_cpu_backward",
          "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward"}
VIEWS = "views (OpOverload.is_view) and " + ", ".join(sorted(_NO_LAUNCH))


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _bytes(*xs) -> int:
    seen, n = set(), 0
    for x in xs:
        for t in _tensors(x):
            if id(t) not in seen:
                seen.add(id(t))
                n += t.numel() * t.element_size()
    return n


def _is_sync(name: str, args, kwargs) -> bool:
    if name in _SYNC_ALWAYS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"):
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or ())
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    return False


def _gemm_flops(name: str, args, out) -> int:
    a = [t for t in args if isinstance(t, torch.Tensor)]
    if name == "mm":
        return 2 * a[0].shape[0] * a[0].shape[1] * a[1].shape[1]
    if name == "addmm":
        return 2 * a[1].shape[0] * a[1].shape[1] * a[2].shape[1]
    if name == "bmm":
        return 2 * a[0].shape[0] * a[0].shape[1] * a[0].shape[2] * a[1].shape[2]
    if name in ("baddbmm", "addbmm"):
        return 2 * a[1].shape[0] * a[1].shape[1] * a[1].shape[2] * a[2].shape[2]
    if "attention" in name:  # q [B, H, T, D], k [B, H, S, D]: QKᵀ and PV; backward 2.5x
        q, k = a[0], a[1]
        if name.endswith("backward"):
            q, k = a[1], a[2]
        f = 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
        return int(2.5 * f) if name.endswith("backward") else f
    return 0


class Counter(TorchDispatchMode):
    """Counts what would launch on a GPU, per phase."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.muted = 0
        self.active = False  # inside ``with counter``: the measured step (not the warm-up)
        self.data = collections.defaultdict(lambda: {
            "launches": 0, "ops": collections.Counter(), "syncs": collections.Counter(),
            "gemm_flops": collections.Counter(), "bytes": 0})

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def launch(self, name: str, flops: int = 0, dtype: torch.dtype | None = None, nbytes: int = 0) -> None:
        # The emulated kernels call this directly: only the measured step counts, not the
        # warm-up (before this check, the warm-up's kernels were counted in "after").
        if not self.active:
            return
        d = self.data[self.phase]
        d["launches"] += 1
        d["ops"][name] += 1
        d["bytes"] += nbytes
        if flops:
            d["gemm_flops"][str(dtype).replace("torch.", "")] += flops

    def sync(self, name: str) -> None:
        if not self.active:
            return
        self.data[self.phase]["syncs"][name] += 1

    @contextlib.contextmanager
    def mute(self):
        self.muted += 1
        try:
            yield
        finally:
            self.muted -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.muted:
            return out
        name = _name(func)
        if _is_sync(name, args, kwargs):
            self.sync(name if name in _SYNC_ALWAYS else name + "(bool mask)")
        if func.is_view or name in _NO_LAUNCH or name == "_local_scalar_dense":
            return out
        flops = _gemm_flops(name, args, out) if name in _GEMMS else 0
        dt = next((t.dtype for t in _tensors(args) if t.is_floating_point()), None)
        self.launch(name, flops, dt, _bytes(args, out))
        return out

    def summary(self) -> dict:
        out = {}
        for ph in ("forward", "backward", "after"):
            d = self.data.get(ph)
            if d is None:
                continue
            out[ph] = {"launches": d["launches"],
                       "syncs": sum(v for k, v in d["syncs"].items() if k in SYNCS),
                       "implicit_syncs": sum(v for k, v in d["syncs"].items() if k not in SYNCS),
                       "sync_kinds": dict(d["syncs"]), "gemm_flops": dict(d["gemm_flops"]),
                       "bytes": d["bytes"], "top_ops": dict(d["ops"].most_common(int(os.environ.get("TOPOPS", 12))))}
        tot = {"launches": sum(v["launches"] for v in out.values()),
               "syncs": sum(v["syncs"] for v in out.values()),
               "implicit_syncs": sum(v["implicit_syncs"] for v in out.values()),
               "gemm_flops": dict(sum((collections.Counter(v["gemm_flops"]) for v in out.values()),
                                      collections.Counter())),
               "bytes": sum(v["bytes"] for v in out.values())}
        return {"total": tot, **out}


@contextlib.contextmanager
def phases(counter: Counter):
    """``torch.autograd.grad``/``backward`` mark the backward phase; what follows is 'after'."""
    grad, backward, tolist = torch.autograd.grad, torch.autograd.backward, torch.Tensor.tolist

    depth = [0]  # rules may call autograd inside a backward (re-running a module)

    def wrap(f):
        def g(*a, **k):
            depth[0] += 1
            counter.phase = "backward"
            try:
                return f(*a, **k)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    counter.phase = "after"
        return g

    def counted_tolist(self):
        if not counter.muted:
            counter.sync("tolist")
        return tolist(self)

    torch.autograd.grad, torch.autograd.backward = wrap(grad), wrap(backward)
    torch.Tensor.tolist = counted_tolist
    try:
        yield
    finally:
        torch.autograd.grad, torch.autograd.backward, torch.Tensor.tolist = grad, backward, tolist


# ----------------------------------------------------------------------- CUDA emulation


@contextlib.contextmanager
def emulate_cuda(counter: Counter):
    """The engine's CUDA bf16/fp16 branches on CPU tensors; each kernel one counted launch."""
    from llmdp.clipping import _triton_rownorms as trn
    from llmdp.clipping import _triton_rowscaled as tr
    from llmdp.clipping import lowp, modes, norms
    from llmdp.clipping.rules import linear as rlinear

    half = lowp.HALF
    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def tc(x, y):
        return x.dtype in half and y.dtype == x.dtype

    def bmm_fast(x, y):
        if not tc(x, y):
            return orig_bmm_fast(x, y)
        k = x.shape[2]
        out = None
        for k0 in range(0, k, tr.CHUNK_T):
            xs, ys = x[:, :, k0:k0 + tr.CHUNK_T], y[:, k0:k0 + tr.CHUNK_T]
            with counter.mute():
                part = torch.bmm(xs.float(), ys.float())
            counter.launch("bmm(out_dtype=float32)", 2 * xs.shape[0] * xs.shape[1] * xs.shape[2] * ys.shape[2],
                           x.dtype, _bytes(xs, ys, part))
            out = part if out is None else out.add_(part)
        return out

    def launch_kernel(kernel, grid, args, kwargs):
        """One Triton launch of ``_triton_rowscaled`` (its wrapper's own torch operations,
        the factors' cast, the sums of partial results, are counted as they run): the
        kernel's result formed in float64 from its arguments, as the kernel forms it."""
        name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        if name.startswith("row_scaled_tn"):
            X, Y, F, OUT, SINK, R, T, A, B, rows_per = args[:10]
            with counter.mute():
                for g in range(OUT.shape[0]):
                    r0, r1 = g * rows_per, min(R, (g + 1) * rows_per)
                    part = torch.einsum("rta,rtb->ab", X[r0:r1].double() * F[r0:r1].double()[:, None, None],
                                        Y[r0:r1].double())
                    if kwargs.get("ACC") and g == 0:
                        part = part + SINK.double()
                    OUT[g] = part.float()
            counter.launch("triton:row_scaled_tn", 2 * R * T * A * B, X.dtype, _bytes(X, Y, F, OUT))
            return
        X, Y, rows, ptr, OUT, T, A, B = args[:8]
        with counter.mute():
            OUT.zero_()
            p = ptr.tolist()
            for u in range(OUT.shape[0]):
                r = rows[p[u]:p[u + 1]]
                h = torch.einsum("rta,rtb->ab", X[r].float(), Y[r].float())
                OUT[u, 0] = h.double().square().sum()
        counter.launch("triton:unit_sq_norms", 2 * X.shape[0] * T * A * B, X.dtype, _bytes(X, Y, OUT))

    def row_norm_bounds(x, scale):
        with counter.mute():
            out = lowp._row_norms_torch(x, scale)
        counter.launch("triton:row_norm_bounds", 0, x.dtype, _bytes(x, out))
        return out

    def row_norm_bounds2(x, y, scale_x, scale_y):
        with counter.mute():
            out = lowp._row_norms_torch(x, scale_x), lowp._row_norms_torch(y, scale_y)
        counter.launch("triton:row_norm_bounds2", 0, x.dtype, _bytes(x, y, *out))
        return out

    h200 = norms.DeviceSpec(*norms._CUDA_SPECS["H200"])

    def device_spec(device, dtype):
        if dtype not in half:
            return norms.DeviceSpec(h200.flops / norms._CUDA_FP32_SLOWDOWN, h200.bandwidth, h200.fp64)
        return h200

    orig_bmm_fast = lowp.bmm_fast
    patch(lowp, "tensor_cores", tc)
    patch(lowp, "on_cpu", lambda x: False)
    patch(lowp, "_triton_path", tc)
    patch(lowp, "bmm_fast", bmm_fast)
    patch(tr, "_launch", launch_kernel)
    patch(tr, "_programs", lambda device: 2 * 132)  # an H200's SMs, two programs each
    patch(trn, "serves", lambda x: x.dtype in trn._DTYPES and x.dim() >= 1 and x.shape[-1] > 0
          and x.stride(-1) == 1)
    patch(trn, "row_norm_bounds", row_norm_bounds)
    patch(trn, "row_norm_bounds2", row_norm_bounds2)
    patch(norms, "device_spec", device_spec)
    patch(rlinear, "device_spec", device_spec)
    patch(modes, "_available_memory", lambda device: 140 * 10**9)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


# ----------------------------------------------------------------------- one step


def model_args(args, lora: bool):
    return argparse.Namespace(
        family="llama", hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
        heads=args.heads, vocab=args.vocab, seq=args.seq, batch=args.batch, device="cpu",
        dtype=args.dtype, lora=lora, lora_rank=args.lora_rank, experts=8, top_k=2)


def count_step(method: str, lora: bool, args) -> dict:
    import clipping as bench  # benchmarks/clipping.py: the same models as the timing bench

    from llmdp.base.losses import row_losses
    from llmdp.clipping import GhostClipper
    from llmdp.train.strategy import Replicated

    margs = model_args(args, lora)
    model, batch = bench.build(margs)
    if args.emulate_cuda:  # what the CUDA bench runs (benchmarks/clipping.py: sdpa on cuda)
        model.config._attn_implementation = "sdpa"
    params = [p for p in model.parameters() if p.requires_grad]
    sinks = None
    counter = Counter()

    def forward():
        counter.phase = "forward"
        losses = row_losses(model, batch)
        counter.phase = "after"  # GhostClipper.backward's work before its first pass
        return losses

    if method == "non-private":
        def step():
            forward().sum().backward()
    else:
        kind = method[len("llmdp-"):]
        sinks = Replicated().grad_sinks(model)
        clipper = GhostClipper(model, 1.0, mode=kind, layer_policy=args.layer_policy, grad_buffers=sinks)

        def step():
            clipper.backward(forward(), batch["row_units"])

    def reset():
        for p in params:
            p.grad = None
        for s in (sinks or {}).values():
            s.zero_()

    with emulate_cuda(counter) if args.emulate_cuda else contextlib.nullcontext():
        reset()
        step()  # warm-up (one-time probes, caches)
        reset()
        t0 = time.perf_counter()
        with phases(counter), counter:
            step()
        wall = time.perf_counter() - t0
    row = {"method": method, "lora": lora, "wall_s_cpu": round(wall, 3), **counter.summary()}
    if method != "non-private":
        row["mode"] = clipper.last_mode
        row["exact_fallbacks"] = clipper.last_norm_stats.fallbacks
        clipper.remove_hooks()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 with --emulate-cuda, else float32")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--configs", default="full,lora", help="full, lora or both")
    ap.add_argument("--layer-policy", default="auto", choices=("auto", "ghost", "instantiate"))
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"of {', '.join(METHODS)}")
    ap.add_argument("--emulate-cuda", action="store_true", help="the CUDA bf16 path, emulated (above)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.emulate_cuda else "float32"
    torch.set_num_threads(args.threads)
    rows = []
    for cfg in args.configs.split(","):
        for m in args.methods.split(","):
            rows.append(count_step(m, cfg == "lora", args))
            print(f"  done: {cfg} {m}", file=sys.stderr, flush=True)
    print(f"Llama d{args.hidden} x {args.layers} layers, {args.heads} heads, intermediate "
          f"{args.intermediate}, vocab {args.vocab}; T{args.seq} x {args.batch}; {args.dtype}; "
          f"{'CUDA path emulated' if args.emulate_cuda else 'CPU path'}; layer policy {args.layer_policy}")
    print(f"{'config':<7}{'method':<20}{'launches':>9}{'fwd':>7}{'bwd':>7}{'after':>7}"
          f"{'syncs':>7}{'bwd':>5}{'after':>6}{'implicit':>9}{'GEMM GFLOP':>12}{'GB':>8}")
    for r in rows:
        ph = {k: r.get(k, {"launches": 0, "syncs": 0, "implicit_syncs": 0}) for k in ("forward", "backward", "after")}
        fl = sum(r["total"]["gemm_flops"].values()) / 1e9
        print(f"{'lora' if r['lora'] else 'full':<7}{r['method']:<20}{r['total']['launches']:>9}"
              f"{ph['forward']['launches']:>7}{ph['backward']['launches']:>7}{ph['after']['launches']:>7}"
              f"{r['total']['syncs']:>7}{ph['backward']['syncs']:>5}{ph['after']['syncs']:>6}"
              f"{r['total']['implicit_syncs']:>9}"
              f"{fl:>12.2f}{r['total']['bytes'] / 1e9:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
