"""DP synthetic data (`llmdp generate`, `llmdp synthetic check|quality`): a corpus sampled from a DP
model, which inherits the model's (ε, δ) as post-processing, with its card, public
statistics, an internal memorization check and an internal quality measurement.

    source.py        the model to sample: a run folder or an export folder, its guarantee
                     (read, never recomputed), provenance chain, record schema; refusals
    inputs.py        what may steer the sampling: public prompts / labels files only
    sampling.py      per-record randomness from (seed, index); batched KV-cache sampling
    output.py        the JSONL written in order, fsync'd, with its progress sidecar (resume)
    generate.py      the command: local or Ray Data, progress bar, the card at the end
    card.py          synthetic_data_card.md / .json
    stats.py         public statistics of the synthetic corpus
    memorization.py  internal: exact overlaps with the training data and the audit's canaries
    mauve.py         a MAUVE-style similarity of two embedding sets
    quality.py       internal: MAUVE and train-on-synthetic / test-on-real against the held-out split

Nothing is imported here: each module is loaded where it is used.
"""
