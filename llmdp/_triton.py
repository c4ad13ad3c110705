"""Triton, optional: the CUDA kernels' import, shared by ``privacy/rng/_triton_chacha.py`` and
``clipping/_triton_rowscaled.py``. ``triton``/``tl`` are None when it does not import (any
failure means: use the torch path). With ``TRITON_INTERPRET=1`` set before the import, the
kernels run on CPU tensors through Triton's interpreter (the tests use this).

``ptxas_usage`` compiles a kernel for a CUDA target without a GPU (Triton's own compiler and
its bundled ``ptxas``) and reports its registers and spills: the kernels' register budget is
checked on any machine (``tests/clipping/test_kernel_spills.py``, ``benchmarks/ptxas.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001
    triton = tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def available() -> bool:
    """Triton is importable (and we are on CUDA, or in Triton's interpreter)."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


class CompilerUnavailable(RuntimeError):
    """This machine cannot compile for the target: no Triton, or no ``ptxas`` for it."""


def _ptxas(capability: int) -> str:
    if triton is None:
        raise CompilerUnavailable("Triton does not import here")
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(capability).path
    except Exception as e:  # noqa: BLE001 - no NVIDIA backend, or no ptxas in it
        raise CompilerUnavailable(f"Triton has no ptxas for sm_{capability} here "
                                  f"({type(e).__name__}: {e})") from e
    if not (path and os.path.isfile(path) and os.access(path, os.X_OK)):
        raise CompilerUnavailable(f"Triton's ptxas for sm_{capability} is not an executable here")
    return path


def ptxas_usage(kernel, args, kwargs, capability: int = 90, aligned: bool = True) -> dict:
    """Compile ``kernel[grid](*args, **kwargs)`` for CUDA sm_``capability`` (no GPU, no
    launch) and return ptxas's report: {"name", "registers", "spill_stores", "spill_loads",
    "stack"} (bytes per thread), with Triton's "shared" (bytes of shared memory a program
    needs) and ``dot_accumulators``' "dots", "dots_from_zero". ``args`` as at a launch;
    tensors may be on the ``meta`` device (only their dtype, strides and alignment matter). The arguments are specialized
    as Triton's launcher does (``tt.divisibility`` attributes, integers equal to 1 as
    constants), the PTX is Triton's own, and ptxas runs with Triton's flags for the target.
    ``aligned=False`` drops the divisibility attributes: the code a launch gets whose sizes,
    strides or pointers are not multiples of 16 (unvectorized loads, more address registers).
    Raises ``CompilerUnavailable`` where that cannot be done."""
    ptxas = _ptxas(capability)
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kwargs = {"debug": False, **kwargs}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization,
                                                              options)
    if not aligned:
        attrs = {key: [a for a in val if a[0] != "tt.divisibility"] for key, val in attrs.items()}
    src = ASTSource(kernel, signature, constexprs, attrs)
    key = (src.hash(), capability, repr(sorted(options.__dict__.items())))
    if key not in _USAGE:  # launches of many shapes share a specialization: compile it once
        _USAGE[key] = _usage(kernel, triton.compile(src, target=target, options=options.__dict__),
                             ptxas, options, sm_arch_from_capability(capability))
    return dict(_USAGE[key])


_USAGE: dict = {}


def _usage(kernel, compiled, ptxas: str, options, arch: str) -> dict:
    flags = ["-lineinfo", "-v", "--regAllocOptLevel=2"]
    if not options.enable_fp_fusion:
        flags.append("--fmad=false")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as fh:
            fh.write(compiled.asm["ptx"])
        r = subprocess.run([ptxas, *flags, f"--gpu-name={arch}", src, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ptxas failed on {kernel.__name__}: {r.stderr[-2000:]}")
    return {**parse_ptxas(r.stdout + r.stderr, kernel.__name__), "shared": compiled.metadata.shared,
            **dot_accumulators(compiled.asm["ttgir"])}


def dot_accumulators(ttgir: str) -> dict:
    """{"dots": the number of dot operations in a kernel's TritonGPU IR (Hopper and older),
    "dots_from_zero": how many of them accumulate into a zero constant}. Any other dot
    continues an earlier tensor-core accumulation chain: Triton folds ``acc + dot(a, b)``
    into ``dot(a, b, acc)`` where the sum is written so."""
    zeros = set(re.findall(r"(%[\w.#]+) = arith\.constant dense<0\.0+e\+00>", ttgir))
    accs = [m.group(1) for m in re.finditer(
        r"= (?:tt\.dot|ttng\.warp_group_dot)\b[^,\n]*, [^,\n]*, (%[\w.#]+)",
        ttgir)]
    return {"dots": len(accs), "dots_from_zero": sum(a in zeros for a in accs)}


def parse_ptxas(log: str, name: str) -> dict:
    """Registers, spills and stack frame of entry ``name`` from a ``ptxas -v`` log."""
    part = log[log.index(f"Function properties for {name}"):]
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      part)
    regs = re.search(r"Used (\d+) registers", part)
    if frame is None or regs is None:
        raise RuntimeError(f"unreadable ptxas report for {name}: {part[:500]}")
    return {"name": name, "registers": int(regs.group(1)), "stack": int(frame.group(1)),
            "spill_stores": int(frame.group(2)), "spill_loads": int(frame.group(3))}
