"""`llmdp generate --ray-data`: the same records as the local path for a seed (CPU actors of
Ray Data's map_batches over blocks of record indices). Both sample batches of the same
records (blocks of the batch size, from record 0), so the same bits: in another batch
shape a record may differ by a token whose uniform falls within the float32 logits'
rounding of a boundary (``llmdp.synthetic.sampling``; test_generate compares batch sizes
in float64)."""

from __future__ import annotations

import pytest

from llmdp.synthetic.generate import generate
from tests.synthetic._runs import make_run

QUIET = {"progress": False, "log": lambda *a: None}
SMALL = {"max_new_tokens": 16, "seed": 11}


@pytest.mark.slow
def test_ray_data_writes_the_records_the_local_path_writes(tmp_path, shared_ray):
    run = make_run(tmp_path)
    local, ray_ = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    generate(run, out=local, num_records=23, batch_size=4, **SMALL, **QUIET)
    generate(run, out=ray_, num_records=23, batch_size=4, ray_data=True, workers=2, **SMALL, **QUIET)
    assert local.read_bytes() == ray_.read_bytes()
    assert len(local.read_text().splitlines()) == 23
