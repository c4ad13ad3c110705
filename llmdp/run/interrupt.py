"""The driver's Ctrl-C while the workers train (`GracefulInterrupt`), and how a launch
tells that its workers stopped on it (`stopped_gracefully`)."""

from __future__ import annotations

import os
import signal
import time

from llmdp.record.rundir import STOP_REQUEST, read_jsonl

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
    the next step (not at the next ``train.checkpoint_every`` boundary), voids in the ledger
    the steps its attempt reserved and will not run, every worker checkpoints that step and
    the train function returns (`llmdp.train.loop.stop_gracefully`); the launch then ends
    its hold, writes the report (status: interrupted) and exits 130. Under a correlated
    mechanism the ledger counts rounds of ``cycle`` steps: a round begun stays charged whole
    (`first_message` says so). The second Ctrl-C stops at once (Ray Train's abort): for the
    ledger that is a crash: steps reserved ahead stay charged though they never ran."""

    def __init__(self, run_dir: str, log, plan=None):
        self.path = os.path.join(run_dir, STOP_REQUEST)
        self.log = log
        self.plan = plan  # the run's DPPlan (what the ledger keeps); None: DP-SGD's wording
        self.count = 0
        self.clear()

    def first_message(self) -> str:
        """What the first Ctrl-C prints: exactly what the stop does."""
        plan = self.plan
        if plan is not None and not plan.dp:
            kept = "no ledger: a NON-PRIVATE baseline"
        elif plan is not None and plan.correlated:
            kept = (f"the ledger keeps every round of {plan.cycle} steps begun, whole: a round "
                    f"is one release of {plan.mechanism}; a round split by the stop is counted "
                    f"again when the run resumes")
        else:
            kept = "the ledger keeps only the steps that ran"
        return ("\nCtrl-C: stopping after the current step, not at the next checkpoint (that "
                f"step's state is checkpointed; {kept}); Ctrl-C again to stop at once")

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
                self.log(self.first_message())
                return
            self.log("\nsecond Ctrl-C: stopping at once (steps reserved ahead stay charged in "
                     "the ledger, as after a crash)")
            try:
                ray.get(controller.abort.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - the controller may be gone already
                pass
            raise KeyboardInterrupt("second Ctrl-C")

        signal.signal(signal.SIGINT, handler)
