"""Statistics of a synthetic corpus: public, since they read the synthetic records only
(post-processing of the DP model, like the records themselves)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np

from llmdp.synthetic.source import Schema

TOP_VALUES = 10


def texts_of(record: dict, schema: Schema) -> list[str]:
    """The generated text of a record (the text, or the assistant / response field)."""
    if schema.mode == "text":
        return [str(record.get(schema.text_field) or "")]
    if schema.mode == "chat":
        return [str(m.get("content") or "") for m in record.get(schema.messages_field) or []
                if m.get("role") == "assistant"]
    return [str(record.get(schema.response_field) or "")]


def read_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _summary(values) -> dict:
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return {"count": 0}
    q = np.percentile(a, [10, 50, 90])
    return {"count": int(a.size), "mean": float(a.mean()), "std": float(a.std()),
            "min": float(a.min()), "p10": float(q[0]), "median": float(q[1]), "p90": float(q[2]),
            "max": float(a.max())}


def statistics(records: list[dict], schema: Schema, tokenizer=None) -> dict:
    """Lengths (characters, words, tokens), vocabulary sizes and the distribution of every
    field, over the synthetic records."""
    texts = [" ".join(texts_of(r, schema)) for r in records]
    words = [t.split() for t in texts]
    out = {
        "computed_on": "the synthetic records only (public: post-processing of the DP model)",
        "records": len(records),
        "length_characters": _summary(len(t) for t in texts),
        "length_words": _summary(len(w) for w in words),
        "vocabulary_words": len({x for w in words for x in w}),
        "empty_texts": sum(1 for t in texts if not t.strip()),
        "duplicate_texts": len(texts) - len(set(texts)),
    }
    if tokenizer is not None:
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] if t else [] for t in texts]
        out["length_tokens"] = _summary(len(i) for i in ids)
        out["vocabulary_tokens"] = len({x for i in ids for x in i})
    fields: dict = {}
    for name in sorted({k for r in records for k in r}):
        values = [r.get(name) for r in records]
        kinds = Counter(type(v).__name__ for v in values)
        entry: dict = {"present": sum(v is not None for v in values), "types": dict(kinds)}
        strings = [v for v in values if isinstance(v, str)]
        if strings:
            counts = Counter(strings)
            entry["distinct"] = len(counts)
            entry["top"] = [[v if len(v) <= 80 else v[:77] + "...", c]
                            for v, c in counts.most_common(TOP_VALUES)]
        lists = [v for v in values if isinstance(v, list)]
        if lists:
            entry["list_length"] = _summary(len(v) for v in lists)
        fields[name] = entry
    out["fields"] = fields
    return out
