"""Stage-free helpers that every layer may use (docs/DESIGN.md §1, layer 0): the test-only
fault plants (`plants`), the small collectives (`collectives`), the causal-LM token losses
(`losses`), the Hugging Face version shims and Hub signals (`hf`) and the watched local Ray
(`localray`). Nothing here imports another llmdp package; this ``__init__`` imports nothing."""
