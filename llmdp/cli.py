"""`llmdp train|audit|sweep|compare|privacy|tokenizer|data|export|generate|synthetic|submit ...`: the command line.

Each subcommand imports its modules when it runs (the imports inside the functions below
are deliberate): `llmdp --help` or `llmdp privacy epsilon` must not pay for torch,
transformers and Ray, which `train` and `export` load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from llmdp.config.choices import Accountant, Mechanism


def _add_plan_args(p: argparse.ArgumentParser, sigma: bool) -> None:
    p.add_argument("--dataset-size", type=int, required=True, help="N, number of privacy units")
    p.add_argument("--batch-size", type=float, required=True, help="expected batch size B = q*N")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--steps", type=int, help="number of DP-SGD steps T")
    g.add_argument("--epochs", type=float, help="epochs; T = ceil(epochs / q)")
    if sigma:
        p.add_argument("--noise-multiplier", type=float, required=True, help="sigma")
    else:
        p.add_argument("--target-epsilon", type=float, required=True)
    p.add_argument("--delta", type=float, default=None, help="default: a power of ten below 1/(10N)")
    p.add_argument("--accountant", choices=Accountant.choices(), default=Accountant.PLD)
    p.add_argument("--parameters", type=int, default=None, metavar="D",
                   help="trainable parameters (the noise coordinates of a step): the noise "
                        "generator's truncated tails are then included in --delta, as `llmdp "
                        "train` does; without it they are not")
    p.add_argument("--mechanism", choices=Mechanism.choices(), default=Mechanism.DP_SGD,
                   help="dp-sgd (independent noise), or correlated noise: banded-mf, blt")
    p.add_argument("--sampler", default=None, metavar="poisson|cyclic-poisson|fixed-cycle",
                   help="default: poisson (dp-sgd), cyclic-poisson (banded-mf), fixed-cycle (blt)")
    p.add_argument("--bands", type=int, default=None, help="banded-mf: the bands b of C")
    p.add_argument("--cycle", type=int, default=None,
                   help="cyclic samplers: the number of groups (default: bands, or N / batch)")
    p.add_argument("--buffers", type=int, default=8, help="blt: the most buffers")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmdp", description="Differentially private fine-tuning of HF causal LMs on Ray Train."
    )
    from llmdp import __version__

    parser.add_argument("--version", action="version", version=f"llmdp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train", help="run a recipe: llmdp train RECIPE [key.sub=value ...]",
        description="Train the recipe with DP-SGD (or correlated noise) on Ray Train, in "
                    "<output.dir>/<output.name>: the plan (N, q, B, T, σ, planned ε) is printed "
                    "first, every step's release is recorded in the dataset's ledger before its "
                    "update is applied, and the run ends with privacy_report.md/.json/.png "
                    "(ε from the ledger). Running the same command again resumes an interrupted "
                    "run from its last checkpoint. Overrides are dotted recipe keys, e.g. "
                    "privacy.target_epsilon=4 train.steps=200.")
    t.add_argument("recipe")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. privacy.target_epsilon=4")
    t.add_argument("--debug", action="store_true",
                   help="check the clipping engine against the exact reference on the first step")
    t.add_argument("--dry-run", action="store_true", help="tokenize and plan only: print N, q, "
                   "σ, T, ε at δ, the truncation and the budget; no ledger entry, no run folder")

    au = sub.add_parser(
        "audit",
        help="empirical privacy audit: llmdp audit RECIPE [key.sub=value ...]",
        description="Train the recipe once more (<output.name>-audit) with canaries, each "
                    "included by a secret keyed coin, score them against the final model and "
                    "report an empirical lower bound on ε (Steinke, Nasr and Jagielski 2023) "
                    "beside the guarantee's ε: audit.json, audit.md and the privacy report's "
                    "'Empirical audit' section. The audit run's DP releases go into the dataset "
                    "ledger like any run's. Re-running the same command resumes it.")
    au.add_argument("recipe")
    au.add_argument("overrides", nargs="*", help="dotted overrides, e.g. privacy.target_epsilon=4")
    au.add_argument("--canaries", type=int, default=None, metavar="M", help="number of canaries, "
                    "half included on average (default 1000 input, 20000 gradient canaries)")
    au.add_argument("--record-fraction", type=float, default=0.5, metavar="F",
                    help="fraction of natural-looking synthetic records; the rest random tokens")
    au.add_argument("--scores", choices=["both", "black-box", "white-box"], default="both",
                    help="black-box: loss reduction; white-box: gradient probe of the update")
    au.add_argument("--canary-kind", choices=["input", "gradient"], default="input", help="input: token canaries, final model; gradient: secret gradient directions, every iterate")
    au.add_argument("--confidence", type=float, default=0.95,
                    help="the lower bound holds with this probability (default 0.95)")

    sw = sub.add_parser(
        "sweep",
        help="accounted hyper-parameter tuning: every trial a DP run in the dataset ledger, "
             "selected by its DP evaluation: llmdp sweep RECIPE --grid optim.lr=1e-3,3e-3",
        description="Run one DP trial per grid point (or a Papernot-Steinke random search), "
                    "select the trial with the lowest DP evaluation loss, and state what the "
                    "sweep cost (<output.dir>/<output.name>-sweep/sweep.json and sweep.md; a "
                    "random search keeps the number of trials, every trial and bound (a) in "
                    "sweep.internal.json/.md, not for publication under its bound (b)). "
                    "Re-running the same command resumes it.")
    sw.add_argument("recipe")
    sw.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=200")
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                    help="a swept key and its values, read as YAML (repeatable; replaces the "
                         "recipe's sweep.grid entry for that key)")
    sw.add_argument("--trials", choices=["grid", "random"], default=None,
                    help="grid: every combination; random: K ~ --distribution of mean "
                         "--mean-trials trials, each a uniformly random grid point")
    sw.add_argument("--mean-trials", type=float, default=None, metavar="M",
                    help="random: the expected number of trials (>= 1)")
    sw.add_argument("--distribution", choices=["poisson", "geometric"], default=None,
                    help="random: the distribution of the number of trials (default poisson)")
    sw.add_argument("--write-best", default=None, metavar="FILE",
                    help="a recipe with data.public: true (trials non-private, or with "
                         "privacy.simulate: true the private run's DP noise simulated; nothing "
                         "spent): write the selected point to FILE; a private recipe takes it "
                         "with train.hyperparameters_from: FILE")

    cp = sub.add_parser(
        "compare", help="runs side by side and the privacy-utility plot: llmdp compare RUN_A "
                        "RUN_B ... [--out FILE.png]",
        description="One line per run from its privacy_report.json: DP or NON-PRIVATE, ε at δ, "
                    "the final held-out loss and accuracy, the final DP evaluation ± std, the "
                    "steps. Runs that differ only by their seed (config.yaml equal but for the "
                    "seeds) are pooled into mean ± sd; runs at one ε whose recipes differ "
                    "otherwise are listed apart with the fields they differ in. The table and "
                    "the plot hold internal metrics: not for publication.")
    cp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    cp.add_argument("--out", default=None, metavar="FILE.png",
                    help="also plot evaluation loss against ε to this PNG")

    priv = sub.add_parser("privacy", help="accounting and dataset ledgers: epsilon, calibrate, report, ledger")
    psub = priv.add_subparsers(dest="privacy_command", required=True)
    _add_plan_args(psub.add_parser("epsilon", help="epsilon of a DP-SGD plan"), sigma=True)
    _add_plan_args(psub.add_parser("calibrate", help="noise multiplier for a target epsilon"), sigma=False)
    r = psub.add_parser("report", help="(re)build and print the privacy report of a run")
    r.add_argument("run_dir")
    r.add_argument("--json", action="store_true")
    r.add_argument("--baseline", default=None, metavar="RUN",
                   help="a NON-PRIVATE run from the same start: the report's internal section "
                        "says what fraction of its gain this run recovers")
    lg = psub.add_parser(
        "ledger", help="the dataset ledgers: list, verify, repair, end-hold, import, set-budget",
        description="Dataset ledgers live in one database: $LLMDP_HOME/ledger.sqlite by default "
                    "(LLMDP_HOME defaults to the user's data directory), or --ledger (a SQLite "
                    "file or a postgresql:// URL, as privacy.ledger in a recipe).")
    lsub = lg.add_subparsers(dest="ledger_command", required=True)

    def _loc(p):
        p.add_argument("--ledger", default=None, metavar="DB",
                       help="the ledgers' database (default: $LLMDP_HOME/ledger.sqlite)")

    ll = lsub.add_parser("list", help="every dataset ledger in the database, with ε spent")
    _loc(ll)
    ll.add_argument("--delta", default=None, metavar="D",
                    help="also show ε spent per privacy unit at δ = D (without it: a ledger "
                         "without a budget at llmdp's default δ for its N; a budgeted ledger shows "
                         "its budget's ε)")
    lv = lsub.add_parser("verify", help="check hash chains: every dataset ledger, one "
                         "(--dataset ID), or a run (RUN_DIR: its ledger.jsonl against its dataset ledger)")
    lv.add_argument("run_dir", nargs="?", default=None)
    lv.add_argument("--dataset", default=None, metavar="ID")
    _loc(lv)
    lr = lsub.add_parser("repair", help="RUN_DIR: rewrite its ledger.jsonl from the dataset "
                         "ledger; --dataset ID --acknowledge-loss: go on past damaged records")
    lr.add_argument("run_dir", nargs="?", default=None)
    lr.add_argument("--dataset", default=None, metavar="ID")
    lr.add_argument("--acknowledge-loss", action="store_true",
                    help="drop the damaged records of a dataset ledger (their releases stop "
                         "being counted); the repair is recorded in the ledger")
    lr.add_argument("--reason", default="", help="why (recorded with the repair)")
    _loc(lr)
    le = lsub.add_parser("end-hold", help="end the budget hold of a run that died where its "
                         "lock file cannot be seen from here (recorded)")
    le.add_argument("run_id")
    le.add_argument("--dataset", required=True, metavar="ID")
    le.add_argument("--reason", default="")
    _loc(le)
    lb = lsub.add_parser(
        "set-budget", help="set or change a dataset's privacy budget (ε, δ, accountant, privacy "
        "unit), recorded in its ledger: the budget every release on that data is checked against",
        description="A budget belongs to the dataset: every release on it (every run, whatever "
                    "its recipe says, every DP evaluation, every private tokenizer) is checked "
                    "against it. Set here, or by the first run with privacy.budget_epsilon; "
                    "changed only here (recorded: who, when, old -> new). A budget below what "
                    "is spent is refused.")
    # Strings, checked by the command: a bad value is one message (exit 2).
    lb.add_argument("--dataset", default=None, metavar="ID")
    lb.add_argument("--epsilon", default=None, metavar="E")
    lb.add_argument("--delta", default=None, metavar="D",
                    help="required for a first budget; default: the recorded one")
    lb.add_argument("--accountant", default=None, metavar="|".join(Accountant.choices()),
                    help="default: the recorded one, else pld")
    lb.add_argument("--unit", default=None, metavar="document|user|sequence",
                    help="the privacy unit; default: the recorded one, else that of the ledger's releases")
    lb.add_argument("--user-field", default=None, metavar="F")
    lb.add_argument("--sequence-length", default=None, metavar="L")
    lb.add_argument("--document-masking", action="store_true")
    lb.add_argument("--reason", default="", help="why (recorded with the budget)")
    lb.add_argument("--create", action="store_true",
                    help="start the dataset's ledger with this budget (no run on it yet)")
    _loc(lb)
    li = lsub.add_parser("import", help="import a JSONL dataset ledger of an earlier llmdp, once")
    li.add_argument("file")
    li.add_argument("--dataset", required=True, metavar="ID", help="the data.dataset_id it belongs to")
    _loc(li)

    tk = sub.add_parser("tokenizer", help="private tokenizers: llmdp tokenizer train RECIPE")
    tksub = tk.add_subparsers(dest="tokenizer_command", required=True)
    tt = tksub.add_parser(
        "train",
        help="train a SentencePiece tokenizer on the private corpus with DP and record the "
             "release in the dataset's ledger: llmdp tokenizer train tokenizers/NAME.yaml",
    )
    tt.add_argument("recipe")
    tt.add_argument("overrides", nargs="*", help="dotted overrides, e.g. privacy.target_epsilon=2")

    dt = sub.add_parser("data", help="look at a recipe's data: llmdp data preview RECIPE")
    pv = dt.add_subparsers(dest="data_command", required=True).add_parser(
        "preview", help="print the first units of a recipe with their loss masks (private data: "
                        "to this console only): llmdp data preview RECIPE [-n 3] [--raw]")
    pv.add_argument("recipe")
    pv.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.unit=document")
    pv.add_argument("-n", "--units", type=int, default=3, help="how many units (default 3)")
    pv.add_argument("--raw", action="store_true", help="also print each row's token ids")
    pv.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                    help="trained tokens green, masked dimmed (auto: on a terminal); never: "
                         "masked text between [[ and ]]")

    e = sub.add_parser(
        "export",
        help="export a finished run as a Hugging Face folder with its privacy report and model "
             "card, and publish it: llmdp export RUN_DIR --to DIR [--push ORG/NAME]",
    )
    e.add_argument("run_dir")
    e.add_argument("--to", required=True, help="the export folder (created; an earlier export of "
                   "the same run is replaced)")
    e.add_argument("--merge", action="store_true",
                   help="LoRA runs: merge the adapter into the base and export full weights")
    e.add_argument("--push", default=None, metavar="ORG/NAME", help="publish to this Hub model repo")
    e.add_argument("--private", action="store_true", help="create the Hub repo as private")
    e.add_argument("--dry-run", action="store_true",
                   help="build the folder and list exactly what would be uploaded; contact nothing")
    e.add_argument("--allow-unverified", action="store_true",
                   help="export a run that fails verification (the card says which checks failed)")
    e.add_argument("--base-model", default=None, metavar="HUB_ID",
                   help="the base model's Hub id, when the recipe named a local path (without "
                        "--push: any name or path, recorded as given)")
    e.add_argument("--license", default=None, help="license in the card's metadata (default: other)")

    g = sub.add_parser(
        "generate",
        help="a synthetic corpus sampled from a DP model, with its card: llmdp generate "
             "RUN_DIR|EXPORT_DIR --num-records N --out FILE",
        description="Sample N records from the final weights of a DP run (or of its export) "
                    "into FILE (JSON lines in the recipe's record schema), then write "
                    "synthetic_data_card.md/.json beside it: the model's (ε, δ) read from its "
                    "privacy report, the provenance chain, the settings and public statistics. "
                    "Every record is post-processing of the DP model: only public prompts or "
                    "labels steer it, nothing filters it. Record i depends only on (--seed, i): "
                    "the batch size and --ray-data change nothing but speed. Re-running the same "
                    "command after a crash resumes at the first missing record.")
    g.add_argument("source", metavar="RUN_DIR|EXPORT_DIR")
    g.add_argument("--num-records", type=int, required=True, metavar="N")
    g.add_argument("--out", required=True, metavar="FILE", help="the JSON-lines output (a "
                   "FILE.progress.json sidecar beside it while it is written)")
    g.add_argument("--seed", type=int, default=0, help="the sampling seed (public; default 0)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0: none)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    gp = g.add_mutually_exclusive_group()
    gp.add_argument("--prompts", default=None, metavar="PUBLIC_FILE",
                    help="public prompts, one a line, cycled over the records (refused if it is "
                         "the recipe's private data or data a ledger records)")
    gp.add_argument("--labels", default=None, metavar="PUBLIC_LIST",
                    help="public labels, one a line: record i is conditioned on label i mod L "
                         "and carries it in a `label` field")
    g.add_argument("--num-users", type=int, default=None, metavar="K",
                   help="records with a user field: synthetic user ids drawn among K "
                        "(default N/10)")
    g.add_argument("--batch-size", type=int, default=16, help="records per forward batch "
                   "(speed only)")
    g.add_argument("--ray-data", action="store_true", help="sample on Ray Data (map_batches "
                   "over blocks of record indices)")
    g.add_argument("--workers", type=int, default=1, help="--ray-data: the actors (one model each)")
    g.add_argument("--filter-with", default=None, metavar="PATH",
                   help="refused: a filter by data is not post-processing (see the message)")
    g.add_argument("--memorization", action="store_true",
                   help="also run the INTERNAL memorization check against the run's training data")
    g.add_argument("--baseline", default=None, metavar="RUN",
                   help="--memorization: the NON-PRIVATE baseline run to compare with (internal)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")

    sy = sub.add_parser("synthetic", help="synthetic corpora: llmdp synthetic check|quality "
                                          "FILE RUN_DIR")
    sys_ = sy.add_subparsers(dest="synthetic_command", required=True)
    sc = sys_.add_parser(
        "check", help="INTERNAL memorization check of a synthetic corpus against the run's "
                      "training data: longest shared token run, k-gram match rate, canaries",
        description="Read the run's private training data (INTERNAL: the numbers are not DP and "
                    "are never published) and report the longest exact token substring a "
                    "synthetic record shares with it, the rate of k-gram matches, the same for "
                    "the NON-PRIVATE baseline's samples (--baseline), and whether any of the "
                    "run's audit canaries is reproduced. Written to "
                    "FILE.memorization.internal.json.")
    sc.add_argument("file", metavar="FILE")
    sc.add_argument("run_dir", metavar="RUN_DIR")
    sc.add_argument("--baseline", default=None, metavar="RUN")
    sc.add_argument("--k", type=int, default=8, help="the n-gram length (default 8)")
    sq = sys_.add_parser(
        "quality", help="INTERNAL quality of a synthetic corpus against the run's held-out data: "
                        "MAUVE, train on synthetic / test on real",
        description="Compare the synthetic corpus with the run's held-out split (INTERNAL: it "
                    "reads private data without DP; the numbers are never published and never "
                    "in the card): a MAUVE score on embeddings of the run's public starting "
                    "model, and the held-out loss of the starting model fine-tuned without DP "
                    "on the synthetic corpus, next to the starting model's, the DP model's and "
                    "(--baseline) the NON-PRIVATE model's (whose samples are scored the same "
                    "way). The run's DP evaluation, when it made one, is quoted as the only DP "
                    "number. Written to FILE.quality.internal.json. With --reference PUBLIC_FILE, "
                    "also MAUVE against that file (declared public, checked not to be the "
                    "recipe's private data): a PUBLIC number, written to "
                    "FILE.quality.public.json and to the synthetic data card.")
    sq.add_argument("file", metavar="FILE")
    sq.add_argument("run_dir", metavar="RUN_DIR")
    sq.add_argument("--baseline", default=None, metavar="RUN",
                    help="the NON-PRIVATE baseline of the same recipe (privacy.dp=false)")
    sq.add_argument("--steps", type=int, default=100,
                    help="steps of the non-private fine-tuning on the synthetic corpus (default 100)")
    sq.add_argument("--lr", type=float, default=1e-3, help="its AdamW learning rate (default 1e-3)")
    sq.add_argument("--batch-size", type=int, default=16, help="its units per step (default 16)")
    sq.add_argument("--max-rows", type=int, default=1000,
                    help="rows of each side embedded for MAUVE (default 1000)")
    sq.add_argument("--seed", type=int, default=0, help="k-means and the fine-tuning's draws")
    sq.add_argument("--dp-epsilon", type=float, default=None, metavar="E",
                    help="also release MAUVE against the held-out split with DP at this ε (one "
                         "Gaussian release recorded in the dataset's ledger, within its budget; "
                         "it goes in the card)")
    sq.add_argument("--reference", default=None, metavar="PUBLIC_FILE",
                    help="a JSONL file of public records in the recipe's schema: MAUVE of the "
                         "corpus against it is public (the card shows it)")

    s = sub.add_parser(
        "submit",
        help="run a recipe on a Ray cluster (Ray Jobs): llmdp submit RECIPE --address ADDR "
             "[key.sub=value ...]",
        description="Validate RECIPE here, then submit `llmdp train RECIPE` as a Ray job that "
                    "ships this checkout as its working dir (docs/LAUNCH.md).",
    )
    s.add_argument("recipe", help="a recipe inside the working dir")
    s.add_argument("overrides", nargs="*", help="dotted overrides, e.g. output.dir=/mnt/shared/runs")
    s.add_argument("--address", default=None,
                   help="the cluster's Ray dashboard, e.g. http://HEAD:8265 (default: $RAY_ADDRESS)")
    s.add_argument("--dry-run", action="store_true",
                   help="print the entrypoint and runtime env as JSON; contact nothing")
    s.add_argument("--working-dir", default=".",
                   help="the folder shipped to the cluster (default: the current one)")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for the job (repeatable), e.g. "
                        "LLMDP_CACHE=/mnt/shared/llmdp-cache")
    s.add_argument("--no-pip", action="store_true",
                   help="do not install llmdp's dependencies in the job's runtime env (the "
                        "cluster's image already has them)")
    s.add_argument("--submission-id", default=None, help="default: llmdp-<run name>-<random>")
    s.add_argument("--no-wait", action="store_true",
                   help="return after submitting instead of following the job's logs")
    s.add_argument("--debug", action="store_true", help="passed on to `llmdp train`")
    _describe_every_command(parser)
    return parser


def _describe_every_command(parser: argparse.ArgumentParser) -> None:
    """Every command's ``--help`` opens with a description: its own, else the one-line help
    the command list shows for it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                sp = action.choices[choice.dest]
                if not sp.description and choice.help:
                    sp.description = choice.help[0].upper() + choice.help[1:] + "."
                _describe_every_command(sp)


class FlagError(ValueError):
    """A bad command-line value; the message names the flag, the value and the fix."""


def _check_plan_flags(a, *, calibrate: bool) -> None:
    """Check every flag of `llmdp privacy epsilon|calibrate` here, so that a bad value is
    reported by its flag (--batch-size), not by the planner's internal names."""
    import math

    from llmdp.privacy.plan import default_delta

    def finite_positive(flag: str, value: float, what: str) -> None:
        if not (math.isfinite(value) and value > 0):
            raise FlagError(f"{flag} {value:g}: {what} must be a finite number > 0")

    n = a.dataset_size
    if n < 1:
        raise FlagError(f"--dataset-size {n}: the number of privacy units N must be at least 1")
    finite_positive("--batch-size", a.batch_size, "the expected batch size B = q*N")
    if a.batch_size > n:
        raise FlagError(
            f"--batch-size {a.batch_size:g} is more than --dataset-size {n}: the expected batch "
            f"size is q*N with a sampling probability q <= 1; use a --batch-size of at most {n}")
    if a.steps is not None and a.steps < 1:
        raise FlagError(f"--steps {a.steps}: the number of DP-SGD steps must be at least 1")
    if a.epochs is not None:
        finite_positive("--epochs", a.epochs, "the number of epochs")
    if a.parameters is not None and a.parameters < 1:
        raise FlagError(f"--parameters {a.parameters}: the number of trainable parameters must "
                        "be at least 1 (or leave --parameters out)")
    if calibrate:
        finite_positive("--target-epsilon", a.target_epsilon, "the target epsilon")
    else:
        finite_positive("--noise-multiplier", a.noise_multiplier, "the noise multiplier sigma")
    if a.delta is not None and not (0 < a.delta < 1.0 / n):
        fix = (f"e.g. --delta {default_delta(n):g} (or leave --delta out: the default is a "
               f"power of ten below 1/(10N))")
        if not a.delta > 0:
            raise FlagError(f"--delta {a.delta:g} must be a number > 0; use {fix}")
        raise FlagError(
            f"--delta {a.delta:g} must be below 1/N = {1.0 / n:.6g} (--dataset-size {n}): a "
            f"delta that large allows publishing a whole privacy unit. Use a smaller --delta, "
            f"{fix}")


def _mechanism_flags(a) -> dict:
    """make_plan's sampler and mechanism config from the flags (refused combinations:
    `mf.plan`; the config's fields read by name: --bands, --cycle, --buffers)."""
    from llmdp._fs import cache_root
    from llmdp.privacy.mechanism import mechanism_config
    from llmdp.privacy.mf import MechanismError, check_mechanism

    sampler = a.sampler or Mechanism(a.mechanism).default_sampler
    try:
        check_mechanism(a.mechanism, sampler, bands=a.bands, cycle=a.cycle)
    except MechanismError as e:
        raise FlagError(f"--{e.field}: {e}") from None
    return {"sampler": sampler, "mechanism": mechanism_config(
        a.mechanism, a, strategy_cache=os.path.join(cache_root(), "mf"))}


def _plan_from_args(a, *, calibrate: bool):
    from llmdp.privacy.plan import NoiseTailError, PlanError, default_delta, make_plan, tail_message

    _check_plan_flags(a, calibrate=calibrate)
    kw = dict(dataset_size=a.dataset_size, expected_batch_size=a.batch_size, max_grad_norm=1.0,
              steps=a.steps, epochs=a.epochs, delta=a.delta, accountant=a.accountant,
              noise_coordinates=a.parameters, **_mechanism_flags(a))
    max_sigma = 100.0
    try:
        if not calibrate:
            return make_plan(noise_multiplier=a.noise_multiplier, **kw)
        return make_plan(target_epsilon=a.target_epsilon, max_noise_multiplier=max_sigma, **kw)
    except NoiseTailError as e:
        more = "a larger --noise-multiplier" if not calibrate else "a smaller --target-epsilon"
        raise FlagError(
            f"--parameters {a.parameters}: {tail_message(e.share, e.delta, e.detail)}. Fix: fewer "
            f"trainable parameters (LoRA), fewer --steps/--epochs, {more}, or a larger --delta "
            f"(still below 1/N)") from None
    except PlanError:
        if not calibrate:
            raise
        # Every flag was checked above: the target cannot be met. Say so in flags.
        try:
            floor = f"epsilon = {make_plan(noise_multiplier=max_sigma, **kw).epsilon():.4g}"
        except PlanError:  # pragma: no cover - the same inputs were accepted above
            floor = "a larger epsilon"
        delta = a.delta if a.delta is not None else default_delta(a.dataset_size)
        length = f"--steps {a.steps}" if a.steps is not None else f"--epochs {a.epochs:g}"
        raise FlagError(
            f"--target-epsilon {a.target_epsilon:g} is unreachable with --dataset-size "
            f"{a.dataset_size} --batch-size {a.batch_size:g} {length} --delta {delta:g} "
            f"--accountant {a.accountant}: even a noise multiplier of {max_sigma:g} gives "
            f"{floor}. To make it reachable: fewer --steps/--epochs, a smaller --batch-size, "
            f"a larger --dataset-size, a larger --target-epsilon, or a larger --delta (still "
            f"below 1/N)") from None


def _print_plan(plan, a, extra: dict) -> None:
    out = {
        "epsilon": plan.epsilon(),
        "delta": plan.delta,
        # the split of δ: the accountant's and the noise tails' (null: --parameters not given,
        # the tails are not included)
        "delta_accountant": plan.accountant_delta,
        "delta_noise_tail": plan.noise_tail_delta,
        "parameters": plan.noise_coordinates,
        "noise_multiplier": plan.noise_multiplier,
        "sampling_probability": plan.sampling_probability,
        "steps": plan.steps,
        "dataset_size": plan.dataset_size,
        "expected_batch_size": plan.expected_batch_size,
        "accountant": plan.accountant,
        "adjacency": "add-or-remove one unit",
        **_mechanism_out(plan),
        **extra,
    }
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>22}: {v}")


def _mechanism_out(plan) -> dict:
    """A correlated plan's mechanism, sampler, rounds and strategy (none for DP-SGD)."""
    if not plan.correlated:
        return {}
    from llmdp.privacy.mf import mf_commitment, participation_text

    fact = plan.factorization()
    return {"mechanism": plan.mechanism, "sampler": plan.sampler, "cycle": plan.cycle,
            "rounds": plan.ledger_steps, "commitment": mf_commitment(plan),
            "participation": participation_text(plan.mechanism, plan.sampler, plan.cycle,
                                                plan.steps, plan.event_probability),
            "strategy": {k: v for k, v in fact.meta.items() if isinstance(v, (int, float, str))}}


def _quiet_libraries() -> None:
    """Our progress bar is the one that matters; silence per-file loading bars."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        # argparse stops filling a positional list at the first option: `train R --debug k=v`
        # or `audit R --canaries 100 k=v` leaves k=v over. Every command that takes overrides
        # takes them anywhere after its recipe, in the order written.
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from llmdp._fs import RunDirInUse, StorageError
    from llmdp.config.schema import ConfigError
    from llmdp.hub.export import ExportError
    from llmdp.privacy.ledger import BudgetError, LedgerError
    from llmdp.privacy.plan import PlanError
    from llmdp.record.checkpoints import CheckpointError
    try:
        if args.command == "train":
            from llmdp.config.schema import load_recipe
            from llmdp.run.launch import run
            from llmdp.run.preflight import dry_run

            overrides = list(args.overrides) + (["privacy.debug_check=true"] if args.debug else [])
            cfg = load_recipe(args.recipe, overrides)
            _quiet_libraries()
            (dry_run if args.dry_run else run)(cfg)
            return 0
        if args.command == "audit":
            from llmdp.config.schema import load_recipe
            from llmdp.run.audit import AuditSettings, run_audit

            m = args.canaries if args.canaries is not None else 20000 if args.canary_kind == "gradient" else 1000
            settings = AuditSettings(m, args.record_fraction, args.scores, args.confidence, args.canary_kind)
            cfg = load_recipe(args.recipe, args.overrides)
            _quiet_libraries()
            result = run_audit(cfg, settings)
            return 3 if result["violation"] else 0
        if args.command == "sweep":
            from llmdp.config.schema import load_recipe
            from llmdp.tune.sweep import run_sweep

            cfg = load_recipe(args.recipe, args.overrides)
            _quiet_libraries()
            run_sweep(cfg, args.grid, trials=args.trials, mean_trials=args.mean_trials,
                      distribution=args.distribution, write_best=args.write_best)
            return 0
        if args.command == "compare":
            from llmdp.report.compare import compare

            compare(args.run_dirs, out=args.out)
            return 0
        if args.command == "tokenizer":
            from llmdp.config.schema import load_tokenizer_recipe
            from llmdp.tokenizer.train import train_tokenizer

            cfg = load_tokenizer_recipe(args.recipe, args.overrides)
            _quiet_libraries()
            train_tokenizer(cfg)
            return 0
        if args.command == "data":
            from llmdp.config.schema import load_recipe
            from llmdp.run.preview import preview

            preview(load_recipe(args.recipe, args.overrides), args.units, raw=args.raw,
                    color={"auto": None, "always": True, "never": False}[args.color])
            return 0
        if args.command == "export":
            from llmdp.hub.export import export_run

            export_run(args.run_dir, args.to, merge=args.merge, push=args.push, private=args.private,
                       dry_run=args.dry_run, allow_unverified=args.allow_unverified,
                       base_model=args.base_model, license=args.license)
            return 0
        if args.command == "generate":
            from llmdp.synthetic.generate import generate

            _quiet_libraries()
            generate(args.source, out=args.out, num_records=args.num_records, seed=args.seed,
                     temperature=args.temperature, top_p=args.top_p,
                     max_new_tokens=args.max_new_tokens, prompts=args.prompts, labels=args.labels,
                     num_users=args.num_users, batch_size=args.batch_size, ray_data=args.ray_data,
                     workers=args.workers, filter_with=args.filter_with,
                     memorization=args.memorization, baseline=args.baseline,
                     progress=not args.no_progress)
            return 0
        if args.command == "synthetic":
            _quiet_libraries()
            if args.synthetic_command == "quality":
                from llmdp.synthetic.quality import quality

                quality(args.file, args.run_dir, baseline=args.baseline, reference=args.reference,
                        dp_epsilon=args.dp_epsilon,
                        steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                        max_rows=args.max_rows, seed=args.seed)
                return 0
            from llmdp.synthetic.generate import check_file

            check_file(args.file, args.run_dir, baseline=args.baseline, k=args.k)
            return 0
        if args.command == "submit":
            from llmdp.run.submit import main as submit_main

            return submit_main(args)
        if args.privacy_command == "epsilon":
            plan = _plan_from_args(args, calibrate=False)
            _print_plan(plan, args, {})
            return 0
        if args.privacy_command == "calibrate":
            plan = _plan_from_args(args, calibrate=True)
            _print_plan(plan, args, {"target_epsilon": args.target_epsilon})
            return 0
        if args.privacy_command == "ledger":
            from llmdp.privacy.ledger import main as ledger_main
            from llmdp.record.rundir import RunDir

            return ledger_main(args, lambda run_dir: RunDir(run_dir).info)
        if args.privacy_command == "report":
            from llmdp.record.rundir import RunDir
            from llmdp.report.build import write_report

            RunDir(args.run_dir).require(ConfigError)
            if args.baseline is not None:
                RunDir(args.baseline).require(ConfigError)
            report = write_report(args.run_dir, baseline=args.baseline)
            if args.json:
                print(json.dumps(report))
            else:
                with open(os.path.join(args.run_dir, "privacy_report.md"), encoding="utf-8") as f:
                    print(f.read())
            return 0
    except (ConfigError, PlanError, ValueError, BudgetError, ExportError, LedgerError,
            RunDirInUse, CheckpointError, StorageError) as e:  # StorageError: a disk's, with its fix
        print(f"llmdp: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # Ctrl-C: a training run has written its report (status: interrupted) already.
        from llmdp.run.launch import RunInterrupted

        why = str(e) if isinstance(e, RunInterrupted) else "interrupted"
        print(f"llmdp: {why}", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
