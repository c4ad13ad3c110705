"""DP synthetic data (`llmdp generate`, `llmdp synthetic check`): a corpus sampled from a DP
model, which inherits the model's (ε, δ) as post-processing, with its card, public
statistics and an internal memorization check.

    source.py        the model to sample: a run folder or an export folder, its guarantee
                     (read, never recomputed), provenance chain, record schema; refusals
    inputs.py        what may steer the sampling: public prompts / labels files only
    sampling.py      per-record randomness from (seed, index); batched KV-cache sampling
    output.py        the JSONL written in order, fsync'd, with its progress sidecar (resume)
    generate.py      the command: local or Ray Data, progress bar, the card at the end
    card.py          synthetic_data_card.md / .json
    stats.py         public statistics of the synthetic corpus
    memorization.py  internal: exact overlaps with the training data and the audit's canaries

Nothing is imported here: each module is loaded where it is used.
"""
