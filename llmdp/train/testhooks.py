"""Test hooks of the worker loop, switched on by environment variables that the tests set
(the driver forwards them to the workers): a fault at a step, a pause for a real Ctrl-C."""

from __future__ import annotations

import json
import os
import time

from llmdp.record.rundir import STOP_REQUEST

__all__ = ["maybe_inject_fault", "maybe_wait_for_ctrl_c"]


def maybe_inject_fault(step: int, rank: int) -> None:
    """Test hook: ``LLMDP_FAULT=step=K,rank=R,marker=PATH[,action=hang]`` makes worker R, once,
    at 0-based step K (after the ledger write, before the update) raise, as a lost worker
    would; with ``action=hang`` it writes its pid to the marker and hangs there until it is
    killed (a test kills its node, or the driver, at that point)."""
    spec = os.environ.get("LLMDP_FAULT")
    if not spec:
        return
    f = dict(item.split("=", 1) for item in spec.split(","))
    if int(f["step"]) == step and int(f.get("rank", 0)) == rank and not os.path.exists(f["marker"]):
        hang = f.get("action") == "hang"
        with open(f["marker"] + ".tmp", "w") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "step": step, "rank": rank, "hang": hang}))
        os.replace(f["marker"] + ".tmp", f["marker"])
        while hang:
            time.sleep(1.0)
        raise RuntimeError(f"injected fault at step {step} on rank {rank} (LLMDP_FAULT)")


def maybe_wait_for_ctrl_c(run, at: str) -> None:
    """Test hook: ``LLMDP_TEST_PAUSE=at=A,marker=PATH`` (A: a 0-based step, or ``final``)
    makes rank 0, at that point (before the step's gate; before the final evaluation),
    write the marker and wait until the driver's first Ctrl-C has written its stop request:
    a test sends a real SIGINT at a known step."""
    spec = os.environ.get("LLMDP_TEST_PAUSE")
    if not spec or run.rank != 0:
        return
    f = dict(item.split("=", 1) for item in spec.split(","))
    if f["at"] != at or os.path.exists(f["marker"]):
        return
    with open(f["marker"] + ".tmp", "w") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "at": at}))
    os.replace(f["marker"] + ".tmp", f["marker"])
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(run.spec.run_dir, STOP_REQUEST)) and time.monotonic() < deadline:
        time.sleep(0.05)
