"""Finished runs for the synthetic-data tests, made by the worker loop in this process (no
Ray): a tiny llama from a config, a few DP steps on a generated private corpus, the report."""

from __future__ import annotations

import os

import pytest

from tests.helpers import tiny_tokenizer_dir, write_notes

TINY = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
        "intermediate_size": 32, "max_position_embeddings": 64}


def make_run(tmp_path, *, name: str = "run", dp: bool = True, rng: str = "secure",
             data=None, user_field: str | None = "user_id", steps: int = 4,
             eval_fraction: float | None = None) -> str:
    from llmdp.config.schema import recipe_from_dict
    from llmdp.report.build import write_report
    from llmdp.run.launch import prepare
    from llmdp.train.loop import LocalContext, train_loop_per_worker

    data = data or write_notes(tmp_path / "notes.jsonl", 30)
    privacy = ({"noise_multiplier": 1.0, "max_grad_norm": 1.0, "rng": rng,
                "ledger": str(tmp_path / "ledger.sqlite"), **({"seed": 3} if rng == "seeded" else {})}
               if dp else {"dp": False})
    raw = {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(), "tiny": TINY},
        "data": {"path": str(data), "sequence_length": 24,
                 **({"user_field": user_field} if user_field else {}),
                 **({"eval": {"fraction": eval_fraction}} if eval_fraction else {})},
        "privacy": privacy,
        "optim": {"name": "adamw", "lr": 5e-2, "schedule": "constant"},
        "train": {"expected_batch_size": 8, "steps": steps, "physical_batch_size": 4,
                  "checkpoint_every": steps},
        "output": {"dir": str(tmp_path / "runs"), "name": name},
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_DATA_HOME", str(tmp_path / "registry"))
        prep = prepare(recipe_from_dict(raw), log=lambda *a: None)
        ckpt = os.path.join(prep.run_dir, "checkpoints", "checkpoint_000000")
        train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
        write_report(prep.run_dir)
    return prep.run_dir


def lines(path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()
