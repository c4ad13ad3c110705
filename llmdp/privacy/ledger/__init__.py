"""The dataset ledgers: every DP release on a dataset, hash-chained in a database, and the
budget kept against them (DESIGN, invariant `write-ahead-ledger`, §4 "The dataset ledgers").

- `records`: the records (canonical JSON, SHA-256 chain) and a run's ``ledger.jsonl``;
- `database`: the ledgers' database (SQLite or PostgreSQL): transactions, repair;
- `verify`: the chain check of a ledger's rows; `anchors`: the head log and the runs'
  files the ledgers are checked against;
- `location`: where the database is; `registry`: every database the user wrote to;
- `dataset`: opening a dataset's ledger for a run (each dataset's one id: `llmdp.data.ids`);
- `service`: the ledger service (the single writer: holds, blocks, budget checks);
- `budget`: the dataset's budget and the arithmetic over records;
- `eval_source`: DP evaluations on a separate private source;
- `cli`: ``llmdp privacy ledger ...`` (handed the reader of a run directory's plan.json:
  run directories are `llmdp.record`, a layer above this one).

Names are looked up in their modules on first use: importing this package loads nothing,
and the ledger's modules do not load torch.
"""

from __future__ import annotations

from llmdp.privacy import entry_point

# Each name code outside this sub-package uses, by the module of it that defines it.
_NAMES = {
    "records": ("EVAL_MECHANISM", "Ledger", "LedgerDamaged", "LedgerError", "VOID_KIND",
                "is_step_release", "net_records", "release_entries", "step_count"),
    "database": ("LedgerDB",),
    "registry": ("marks_text", "recorded"),
    "location": ("describe_location", "is_url", "llmdp_home", "resolve_location"),
    "dataset": ("check_declared_public", "check_public_eval", "open_dataset_ledger"),
    "service": ("BudgetError", "LedgerService", "cross_check", "run_ledger_problems"),
    "budget": ("DatasetBudget", "budget_refusal", "budget_status", "check_release",
               "dataset_epsilon", "first_budget_record", "hold_entries", "holder_alive",
               "live_holds", "recipe_mismatch", "recorded_budget", "release_entries_of",
               "split_by_unit", "unit_epsilon", "unit_key"),
    "cli": ("main",),
}
__all__, __getattr__, __dir__, _HOMES = entry_point(__name__, _NAMES)
