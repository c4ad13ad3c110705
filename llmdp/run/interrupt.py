"""The driver's Ctrl-C while the workers train (`GracefulInterrupt`), and how a launch
tells that its workers stopped on it (`stopped_gracefully`)."""

from __future__ import annotations

import os
import signal
import time

from llmdp.run.rundir import STOP_REQUEST, read_jsonl

__all__ = ["GracefulInterrupt", "stopped_gracefully"]


def stopped_gracefully(run_dir: str) -> bool:
    """Whether the workers' last act was a graceful stop (`llmdp.train.loop.stop_gracefully`)."""
    acts = [m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
            if m.get("event") in ("start", "end", "stopped", "interrupted")]
    return bool(acts and acts[-1].get("event") == "interrupted" and acts[-1].get("graceful"))


class GracefulInterrupt:
    """The driver's Ctrl-C while the workers train (installed by Ray Train's controller
    start-up in place of its own handler, which aborts the workers wherever they are).

    The first Ctrl-C writes the run directory's `rundir.STOP_REQUEST`: rank 0 sees it before
    the next step, voids in the ledger the steps its attempt reserved and will not run,
    every worker checkpoints and the train function returns (`llmdp.train.loop.stop_gracefully`);
    the launch then ends its hold, writes the report (status: interrupted) and exits 130.
    The second Ctrl-C stops at once (Ray Train's abort): for the ledger that is a crash:
    steps reserved ahead stay charged though they never ran."""

    def __init__(self, run_dir: str, log):
        self.path = os.path.join(run_dir, STOP_REQUEST)
        self.log = log
        self.count = 0
        self.clear()

    def clear(self) -> None:
        try:
            os.remove(self.path)  # left by an earlier launch
        except FileNotFoundError:
            pass

    @property
    def requested(self) -> bool:
        return self.count > 0

    def install(self, controller) -> None:
        import ray

        def handler(signum, frame):
            self.count += 1
            if self.count == 1:
                with open(self.path, "w", encoding="utf-8") as f:
                    f.write(f"{time.time()}\n")
                self.log("\nCtrl-C: stopping after the current step (its state is saved, and the "
                         "ledger keeps only the steps that ran); Ctrl-C again to stop at once")
                return
            self.log("\nsecond Ctrl-C: stopping at once (steps reserved ahead stay charged in "
                     "the ledger, as after a crash)")
            try:
                ray.get(controller.abort.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - the controller may be gone already
                pass
            raise KeyboardInterrupt("second Ctrl-C")

        signal.signal(signal.SIGINT, handler)
