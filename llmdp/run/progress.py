"""The driver's progress bar: rank 0 writes metrics.jsonl, the driver follows it (DESIGN §1).

The bar's ε (``eps(ledger)``) is what the ledger has charged so far, like the report's:
steps reserved ahead of the current one (write-ahead blocks of ``train.checkpoint_every``)
and steps re-executed after a failure count; the last value, computed exactly, is the
report's ε. ``eval`` is the latest held-out loss and ``dp_eval`` the latest DP evaluation's
loss, each updated when it is written, so that the last values are the report's last rows.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from tqdm import tqdm

from llmdp.config.choices import Sampler
from llmdp.record.baseline import NON_PRIVATE
from llmdp.report.spent import ledger_epsilon

EPS_KEY = "eps(ledger)"  # charged so far, steps reserved ahead included (module docstring)


def mechanism_label(plan) -> str:
    """The run's mechanism as the console names it: dp-sgd, banded-mf or blt (correlated
    noise), or NON-PRIVATE for a baseline."""
    return plan.mechanism if plan.dp else NON_PRIVATE


def batch_note(plan, requested: float) -> str:
    """Why the plan's expected batch B is not ``train.expected_batch_size`` (empty when it
    is): a fixed-cycle sampler splits the N units into ``cycle`` groups and each step takes
    one whole group, so B = N / cycle."""
    b = float(plan.expected_batch_size)
    if abs(b - float(requested)) <= 1e-9 * max(1.0, b):
        return ""
    if plan.sampler == Sampler.FIXED_CYCLE and plan.cycle:
        return (f" (fixed-cycle sampler: each step takes one of {plan.cycle} groups of the N "
                f"units, B = N/{plan.cycle} = {b:.4g}, not train.expected_batch_size = "
                f"{float(requested):g})")
    return f" (not train.expected_batch_size = {float(requested):g})"


class Progress(threading.Thread):
    """Rank 0 writes metrics.jsonl; the driver turns it into a progress bar. Its ε is the
    ledger's (``ledger.jsonl`` next to metrics.jsonl), like the report's: steps re-executed
    after a failure count again; the last value, computed exactly, is the report's ε."""

    def __init__(self, path: str, plan, prior_releases=(), ledger_path: str | None = None,
                 spends: bool | None = None):
        super().__init__(daemon=True)
        self.path, self.total, self.plan = path, plan.steps, plan
        # False: a NON-PRIVATE baseline (labelled so) or a simulated run (``spends`` False:
        # privacy.simulate): no ledger, no ε to show
        self.dp = plan.dp if spends is None else spends
        self.ledger_path = ledger_path or os.path.join(os.path.dirname(path), "ledger.jsonl")
        self.prior = list(prior_releases)  # e.g. the private tokenizer's release: ε starts there
        self._eps_at = (0, 0.0)  # (step, epsilon): epsilon spent so far, recomputed now and then
        self._eps_time = 0.0
        self.stop = threading.Event()
        self._offset = os.path.getsize(path) if os.path.exists(path) else 0

    def run(self) -> None:
        bar = tqdm(total=self.total, desc=mechanism_label(self.plan), unit="step", dynamic_ncols=True, file=sys.stdout)
        last = {}
        while not self.stop.is_set():
            self._poll(bar, last)
            self.stop.wait(0.5)
        self._poll(bar, last, final=True)
        bar.close()

    def _ledger_epsilon(self, exact: bool) -> float:
        return ledger_epsilon(self.ledger_path, self.plan, self.prior, exact=exact)[1]

    def _poll(self, bar, last, final: bool = False) -> None:
        self._read_metrics(bar, last)
        if final and self.dp:  # the run is over: the ledger's ε, exactly as the report computes it
            last["eps"] = self._ledger_epsilon(exact=True)
            bar.set_postfix({**last.get("post", {}), EPS_KEY: f"{last['eps']:.2f}"}, refresh=False)
            bar.refresh()

    def _read_metrics(self, bar, last) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            chunk = f.read()
        lines = chunk.split("\n")
        complete, rest = lines[:-1], lines[-1]
        self._offset += len(chunk.encode()) - len(rest.encode())
        for line in complete:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("event") in ("eval", "dp_eval") and rec.get("loss") is not None:
                # held-out loss (internal on private data); a DP evaluation's (publishable)
                last[rec["event"]] = rec["loss"]
                self._show(bar, last)
                continue
            if rec.get("event") == "start":
                bar.n = rec["step"]
                continue
            if "step" not in rec or "event" in rec:
                continue
            bar.n = rec["step"]
            now = time.monotonic()
            # PLD costs ~0.5 s of the CPU the workers use: refresh at most every 10% of the run.
            due = rec["step"] - self._eps_at[0] >= max(1, self.total // 10)
            if self.dp and rec["step"] != self._eps_at[0] and ((due and now - self._eps_time > 5) or rec["step"] == self.total):
                # epsilon of every release in the ledger so far (display grid: conservative)
                eps = self._ledger_epsilon(exact=False)
                self._eps_at = (rec["step"], eps)
                self._eps_time = time.monotonic()
                last["eps"] = self._eps_at[1]
            if rec.get("train_loss") is not None:
                last["loss"] = rec["train_loss"]
            last["rates"] = ((rec["tokens_per_s"], rec["units_per_s"]) if rec.get("tokens_per_s")
                             else last.get("rates"))
            self._show(bar, last)

    @staticmethod
    def _show(bar, last) -> None:
        post = {}
        if "loss" in last:
            post["loss"] = f"{last['loss']:.3f}"
        if "eval" in last:
            post["eval"] = f"{last['eval']:.3f}"
        if "dp_eval" in last:
            post["dp_eval"] = f"{last['dp_eval']:.3f}"
        if "eps" in last:
            post[EPS_KEY] = f"{last['eps']:.2f}"
        if last.get("rates"):
            post["tok/s"] = f"{last['rates'][0]:.0f}"
            post["units/s"] = f"{last['rates'][1]:.1f}"
        last["post"] = post
        bar.set_postfix(post, refresh=False)
        bar.refresh()
