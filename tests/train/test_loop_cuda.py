"""The worker loop in-process on CUDA (issue 15, item 5): full fine-tuning and LoRA,
replicated, and fsdp with world size 1 on NCCL, each to its privacy report. GPU only: CI
has no GPU, these skip there (conftest); run them on a GPU machine with
``pytest -o addopts="" --import-mode=importlib -m gpu tests/train/test_loop_cuda.py``."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from llmdp.config.schema import recipe_from_dict, to_dict
from llmdp.train.loop import LocalContext, train_loop_per_worker
from tests.train.test_loop import make_recipe, prepared_config

pytestmark = pytest.mark.gpu


def _recipe(tmp_path, *, lora: bool, strategy: str, mixed: str):
    raw = to_dict(make_recipe(tmp_path, steps=3, checkpoint_every=3))
    raw["scaling"] = {**raw.get("scaling", {}), "use_gpu": True, "strategy": strategy,
                      "mixed_precision": mixed}
    raw["model"]["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]} if lora else None
    return recipe_from_dict(raw)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy", ["replicated", "fsdp"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("mixed", ["none", "bf16"])
def test_worker_loop_on_cuda_to_its_report(tmp_path, monkeypatch, strategy, lora, mixed):
    import torch.distributed as dist

    from llmdp.privacy.noise import gaussian as noise
    from llmdp.report.build import write_report

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    devices = []
    real_add = noise.add_gaussian_

    def spy(t, *a, **k):  # the noise is drawn where the sums are: on the GPU
        devices.append(t.device.type)
        return real_add(t, *a, **k)

    monkeypatch.setattr(noise, "add_gaussian_", spy)
    prep = prepared_config(_recipe(tmp_path, lora=lora, strategy=strategy, mixed=mixed))
    started = False
    if strategy == "fsdp":  # world size 1 on NCCL, in this process
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
        started = True
    try:
        train_loop_per_worker(prep, LocalContext())
    finally:
        if started:
            dist.destroy_process_group()
    assert devices and set(devices) == {"cuda"}
    with open(os.path.join(prep.run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if '"step"' in line]
    losses = [s["train_loss"] for s in steps if s.get("train_loss") is not None]
    assert losses and all(math.isfinite(x) for x in losses)
    r = write_report(prep.run_dir)
    assert r["steps"] == 3 and 0 < r["epsilon"] < math.inf
    assert "ChaCha20" in r["noise_generator"]["method"]
