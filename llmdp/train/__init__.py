"""What runs on a worker: the loop (`loop.train_loop_per_worker`), one DP step's share
(`step`), the replicated / FSDP strategies (`strategy`) and their collectives (`parallel`),
per-unit losses (`losses`), model loading (`models`, `hf`), checkpoints (`checkpoints`)
and the loop's test hooks (`testhooks`)."""
