"""Secure Gaussian noise vs torch.randn, on the same device, in one run (issue 14).

For each device (CPU, and CUDA when present) it times, for the same count of float32
normals,

* ``llmdp.privacy.noise.gaussian.add_gaussian_``: ChaCha20 (RFC 8439) keystream + Box-Muller in
  float64, added in place to a float32 tensor (what a DP step does to its clipped sums);
* ``torch.randn(count)`` on the same device (a new tensor: the issue's baseline), and
  ``torch.randn(out=)`` into a preallocated one (the bare PRNG); neither is secure;
* on CUDA also the torch-ops fallback (no Triton), the keystream alone, and the fused
  kernel's instruction mix (``instruction_mix``: what bounds it),

and prints normals/s, the ratio secure / randn, and the seconds of noise per step for 1 B
and 8 B parameters (the measured rate; on CUDA the 1.6 B figure is measured directly
when memory allows).

    python benchmarks/noise.py                  # CPU: 10 M normals; CUDA: 1.6 B
    python benchmarks/noise.py --cpu-count 20000000 --repeats 7
    python benchmarks/noise.py --json out.json

Timing: best of ``--repeats`` after one warm-up (CUDA: synchronized, CUDA events).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmdp.privacy.noise import gaussian as noise
from llmdp.privacy.rng import chacha  # noqa: E402


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (Triton compiles here)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_device(device: torch.device, count: int, repeats: int, sass_out: str | None = None) -> dict:
    key = os.urandom(32)
    t = torch.zeros(count, dtype=torch.float32, device=device)
    out = torch.empty_like(t)
    res = {"device": str(device), "count": count}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)
    else:
        res["cpu_threads"] = torch.get_num_threads()
    secure = _time(lambda: noise.add_gaussian_(t, key, 0, 1.0), device, repeats)
    # torch.randn(count): a new tensor, as the baseline (and a non-secure DP step's
    # `grad += torch.randn_like(grad) * std` allocates one too); randn(out=): the bare PRNG.
    randn = _time(lambda: torch.randn(count, device=device), device, repeats)
    randn_out = _time(lambda: torch.randn(count, out=out), device, repeats)
    res.update(secure_s=secure, randn_s=randn, ratio=secure / randn,
               randn_out_s=randn_out, ratio_vs_randn_out=secure / randn_out,
               secure_normals_per_s=count / secure, randn_normals_per_s=count / randn)
    for label, params in (("1B", 1_000_000_000), ("8B", 8_000_000_000)):
        res[f"secure_s_per_step_{label}"] = params / res["secure_normals_per_s"]
        res[f"randn_s_per_step_{label}"] = params / res["randn_normals_per_s"]
    if device.type == "cuda":
        from llmdp.privacy.rng import _triton_chacha

        res["triton"] = _triton_chacha.available()
        n_words = min(count * 2, 1 << 30)
        res["keystream_words_per_s"] = n_words / _time(
            lambda: chacha.chacha20_keystream(key, b"\0" * 12, 0, n_words, device), device, repeats)
        m = min(count, 1 << 26)
        small = t[:m]
        fb = _time(lambda: noise._add_chunked(small, key, noise._nonce(0), 0, m, 1.0, noise._CHUNK_PAIRS_TORCH),
                   device, 1)
        res["torch_fallback_normals_per_s"] = m / fb
        try:
            res["instruction_mix"] = instruction_mix(device, sass_out)
        except Exception as e:  # noqa: BLE001 - a diagnostic: never lose the timings for it
            res["instruction_mix"] = f"{type(e).__name__}: {e}"
    return res


def sass_opcodes(text: str) -> list[str]:
    """The opcodes of a SASS listing, in either of the forms seen: cuobjdump's
    (``/*0040*/  @P0 IMAD.IADD R1, ...``) and Triton 3.6's with a control-code column
    (``--:-:0:-:8<TAB>LDC R1, ...``)."""
    import re

    pred = r"(?:@!?U?P\w+\s+)?"
    op = r"([A-Z][A-Z0-9_]*)(?:\.[\w.]+)?"
    found = re.findall(r"/\*[0-9a-f]{4,}\*/\s+" + pred + op, text)
    return found or re.findall(r"^[0-9a-fA-FYy:-]+\t" + pred + op, text, re.M)


def instruction_mix(device: torch.device, sass_out: str | None = None) -> dict:
    """The fused kernel's compiled instructions by opcode (SASS when Triton can disassemble,
    else PTX), per thread: the kernel is straight-line code (the 10 double rounds and the
    transform are unrolled), so these counts divided by the ChaCha blocks a thread computes
    give the work per block, and with the device's issue rates the kernel's floor."""
    import collections
    import re

    from llmdp.privacy.rng import _triton_chacha as k

    t = torch.zeros(4096, dtype=torch.float32, device=device)
    kn = k._key_nonce_tensor(b"\0" * 32, b"\0" * 12, device)
    consts = torch.tensor([-2.0, k._TWO_PI_2M53], dtype=torch.float64, device=device)
    n_blocks = 1024
    compiled = k.gauss_add_kernel[(k.triton.cdiv(n_blocks, k._BLOCK),)](
        t, kn, consts, 0, 4096, 0, n_blocks, BLOCK=k._BLOCK)
    kind, text = "ptx", compiled.asm.get("ptx", "")
    try:
        sass = compiled.asm["sass"]
        if sass:
            kind, text = "sass", sass
    except Exception as e:  # noqa: BLE001 - no disassembler: PTX it is
        print(f"no SASS ({type(e).__name__}: {e}); counting PTX")
    if sass_out:
        with open(sass_out, "w") as f:
            f.write(text)
    if kind == "sass":
        ops = sass_opcodes(text)
    else:
        ops = re.findall(r"^\s+(?:@%p\d+\s+)?([a-z][a-z0-9]*)(?:\.[\w.]+)?\s", text, re.M)
    hist = collections.Counter(ops)
    warps = compiled.metadata.num_warps
    mix = {"kind": kind, "num_warps": warps, "blocks_per_thread": k._BLOCK / (32 * warps),
           "instructions": sum(hist.values()), "top": dict(hist.most_common(24))}
    print(json.dumps(mix))
    return mix


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-count", type=int, default=10_000_000, help="normals per CPU draw")
    ap.add_argument("--cuda-count", type=int, default=1_600_000_000, help="normals per CUDA draw")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--sass", help="CUDA: write the fused kernel's disassembly here")
    args = ap.parse_args(argv)
    results = [bench_device(torch.device("cpu"), args.cpu_count, args.repeats)]
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
        count = min(args.cuda_count, int(free * 0.4) // 4)  # t and randn's out, float32
        results.append(bench_device(torch.device("cuda"), count, args.repeats, args.sass))
    else:
        print("no CUDA device: GPU figures not measured (run this on a GPU machine)")
    for r in results:
        print(json.dumps(r))
    print()
    print(f"{'device':28} {'count':>13} {'secure M/s':>11} {'randn M/s':>10} {'secure/randn':>13} "
          f"{'/randn(out=)':>13} {'s/step 1B':>10} {'s/step 8B':>10}")
    for r in results:
        name = r.get("gpu", f"cpu ({r.get('cpu_threads')} threads)")
        print(f"{name[:28]:28} {r['count']:>13,} {r['secure_normals_per_s'] / 1e6:>11.1f} "
              f"{r['randn_normals_per_s'] / 1e6:>10.1f} {r['ratio']:>12.2f}x "
              f"{r['ratio_vs_randn_out']:>12.2f}x "
              f"{r['secure_s_per_step_1B']:>10.3f} {r['secure_s_per_step_8B']:>10.3f}")
    target = {"cpu": 2.0, "cuda": 4.0}
    for r in results:
        kind = r["device"].split(":")[0]
        ok = r["ratio"] <= target[kind]
        print(f"target {kind}: secure <= {target[kind]:g}x randn: {'met' if ok else 'NOT met'} "
              f"({r['ratio']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
