# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.llmdp-installed

.PHONY: install demo demo-tune demo-private-tokenizer demo-synthetic test test-quick lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first, so that the `torch>=2.4` range adds nothing.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Two stages: pretrain on public text (no DP, nothing spent; a second `make demo` finds it
# complete), then fine-tune that model with DP on the private notes.
demo: $(STAMP)
	$(BIN)/llmdp train recipes/demo-pretrain.yaml
	$(BIN)/llmdp train recipes/demo-finetune.yaml

# The demo's tuning at zero ε: the fine-tuning recipe on new public notes with the private
# run's DP noise simulated (recipes/demo-tune.yaml: its σ, C, B, T; nothing recorded or
# spent), one trial per learning rate (about 7 minutes); the selection -> recipes/tuned/demo-finetune.yaml,
# which recipes/demo-finetune.yaml takes with train.hyperparameters_from (committed: `make demo`
# uses it without the sweep's minutes; BENCHMARKS.md, issue 54).
demo-tune: $(STAMP)
	$(BIN)/llmdp train recipes/demo-pretrain.yaml
	$(BIN)/llmdp sweep recipes/demo-tune.yaml --write-best recipes/tuned/demo-finetune.yaml

# The demo with a tokenizer trained on the private notes with DP (two releases, one report).
demo-private-tokenizer: $(STAMP)
	$(BIN)/llmdp tokenizer train tokenizers/demo-private.yaml
	$(BIN)/llmdp train recipes/tiny-cpu-private-tokenizer.yaml

# After `make demo` (which it leaves unchanged): 1,000 synthetic notes sampled from the demo's
# DP model (ε = 8), with synthetic_data_card.md/.json beside them; then the NON-PRIVATE baseline
# of the same recipe with AdamW at 3e-3 (the recipe's SGD at lr 0.5 is tuned for clipped,
# noisy updates and diverges without them: held-out loss 14.8, BENCHMARKS.md issue 55), the
# INTERNAL memorization check of the corpus against both and its INTERNAL quality against the
# held-out split (MAUVE, train on synthetic / test on real), with the PUBLIC MAUVE against the
# demo's public notes (the pretraining corpus) written into the card.
demo-synthetic: $(STAMP)
	$(BIN)/llmdp generate runs/demo-finetune --num-records 1000 --max-new-tokens 128 \
		--out runs/demo-synthetic/notes.jsonl
	$(BIN)/llmdp train recipes/demo-finetune.yaml privacy.dp=false eval.epsilon=null \
		train.hyperparameters_from=null optim.name=adamw optim.lr=3e-3 optim.momentum=0.0 \
		output.name=demo-finetune-nonprivate
	$(BIN)/llmdp synthetic check runs/demo-synthetic/notes.jsonl runs/demo-finetune \
		--baseline runs/demo-finetune-nonprivate
	$(BIN)/llmdp synthetic quality runs/demo-synthetic/notes.jsonl runs/demo-finetune \
		--baseline runs/demo-finetune-nonprivate \
		--reference $${LLMDP_CACHE:-.cache/llmdp}/demo/public_notes.jsonl

# Two pytest workers, one per core of the 2-core reference machine (pytest-xdist;
# `make test PYTEST_WORKERS=0` runs in one process); an idle worker takes tests queued on
# the busy one (worksteal).
PYTEST_WORKERS ?= 2
# The tests start a few hundred Python processes (Ray's workers and actors, launches, the
# forkserver, benchmark children), each importing llmdp and the tests' helpers. An
# environment with PYTHONDONTWRITEBYTECODE set (container images often set it) would make
# every one of them compile llmdp again, and pytest rewrite every test module
# in both of its workers: the test run writes its bytecode (__pycache__/, git-ignored).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest

test: $(STAMP)
	$(PYTEST) -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist worksteal --durations=20

test-quick: $(STAMP)
	$(PYTEST) -q -n $(PYTEST_WORKERS) --dist worksteal -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check llmdp tests benchmarks

clean:
	rm -rf runs .cache .pytest_cache
