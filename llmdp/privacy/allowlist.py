"""Allow-lists: what may leave a run or a tokenizer folder is named, field by field; the
rest is dropped (DESIGN, invariant `only-dp-outputs-leave`). Shared by the publishable report and ledger (``publish.py``)
and the private tokenizer's folder (``tokenizer/train.py``)."""

from __future__ import annotations

import json


def allow_listed(value, spec):
    """The part of ``value`` that the allow-list ``spec`` names (a deep, JSON-only copy)."""
    if spec is True or value is None:
        return json.loads(json.dumps(value))  # a deep, JSON-only copy
    if isinstance(value, list):
        return [allow_listed(v, spec) for v in value]
    if not isinstance(value, dict):
        return None  # a scalar where the allow-list expects a mapping: not published
    return {k: allow_listed(value[k], sub) for k, sub in spec.items() if k in value}
