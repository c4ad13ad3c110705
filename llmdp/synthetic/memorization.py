"""The memorization check of a synthetic corpus (INTERNAL: it reads the private training
data without DP; its numbers are never put in the card or published).

For the corpus (and, given a NON-PRIVATE baseline run, for the same number of records that
the baseline's model samples with the same settings):

- the longest exact token substring a synthetic record shares with a training record
  (binary search over the length k: a shared k-gram implies a shared (k-1)-gram), with one
  example located and compared token by token;
- the rate of k-gram matches (k = 8 by default): the fraction of the synthetic k-token
  windows that occur in the training data, and the fraction of records with at least one;
- the audit's input canaries, when the run had them (``audit/canaries.jsonl`` of an
  `llmdp audit` run): how many are reproduced verbatim (the canary's text inside a
  synthetic record), included and left out by their coins, and the longest token run any
  canary shares with the corpus.

k-grams are compared by a 64-bit polynomial hash (wrapping uint64 arithmetic, numpy); the
longest match's example is checked token by token.
"""

from __future__ import annotations

import json
import os

import numpy as np

from llmdp.synthetic.source import GenerateError, ModelSource, Schema

BANNER = ("INTERNAL: computed on the private training data without DP; for the data owner's "
          "own check, never published with the corpus")
_BASE = np.uint64(0x9E3779B97F4A7C15)


class Corpus:
    """Token sequences, concatenated, with each token's document."""

    def __init__(self, docs: list[list[int]]):
        self.docs = [np.asarray(d, dtype=np.int64) for d in docs]
        lengths = np.array([len(d) for d in self.docs], dtype=np.int64)
        self.tokens = (np.concatenate(self.docs) if self.docs else np.zeros(0, np.int64)).astype(np.uint64) + np.uint64(1)
        self.doc = np.repeat(np.arange(len(self.docs)), lengths)
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
        self.max_len = int(lengths.max()) if len(lengths) else 0

    def kgrams(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(hash, start position) of every k-token window inside one document."""
        n = len(self.tokens) - k + 1
        if k < 1 or n <= 0:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        h = np.zeros(n, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for j in range(k):
                h = h * _BASE + self.tokens[j:j + n]
        pos = np.arange(n)
        ok = self.doc[:n] == self.doc[k - 1:k - 1 + n]
        return h[ok], pos[ok]


def _member(a: np.ndarray, table: np.ndarray) -> np.ndarray:
    if table.size == 0 or a.size == 0:
        return np.zeros(a.shape, dtype=bool)
    i = np.searchsorted(table, a).clip(max=table.size - 1)
    return table[i] == a


def overlap(synth: Corpus, train: Corpus, k: int = 8) -> dict:
    """The longest shared token substring and the k-gram match rates of ``synth`` in ``train``."""
    def shared(n: int) -> bool:
        a, _ = synth.kgrams(n)
        t, _ = train.kgrams(n)
        return bool(_member(a, np.unique(t)).any())

    lo, hi = 0, min(synth.max_len, train.max_len)
    while lo < hi:  # the largest n with a shared n-gram
        mid = (lo + hi + 1) // 2
        if shared(mid):
            lo = mid
        else:
            hi = mid - 1
    example = None
    if lo > 0:
        a, apos = synth.kgrams(lo)
        t, tpos = train.kgrams(lo)
        order = np.argsort(t, kind="stable")
        hit = np.flatnonzero(_member(a, t[order]))
        for i in hit[:32]:
            j = tpos[order][np.searchsorted(t[order], a[i])]
            if np.array_equal(synth.tokens[apos[i]:apos[i] + lo], train.tokens[j:j + lo]):
                example = {"synthetic_record": int(synth.doc[apos[i]]), "training_record": int(train.doc[j]),
                           "tokens": lo}
                break
    a, apos = synth.kgrams(k)
    t, _ = train.kgrams(k)
    m = _member(a, np.unique(t))
    records_with = len(np.unique(synth.doc[apos[m]])) if m.any() else 0
    return {
        "longest_shared_tokens": int(lo),
        "longest_example_verified": example is not None if lo else None,
        "longest_example": example,
        "k": k,
        "kgram_windows": int(a.size),
        "kgram_match_rate": float(m.mean()) if a.size else 0.0,
        "records_with_kgram_match": int(records_with),
        "records_with_kgram_match_rate": records_with / max(1, len(synth.docs)),
        "records": len(synth.docs),
    }


def tokenize(texts: list[str], tokenizer) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] if t else [] for t in texts]


def training_texts(source: ModelSource) -> list[str]:
    """The generated-side texts of the run's training corpus (its data.path)."""
    from llmdp.data.sources import load_records
    from llmdp.synthetic.stats import texts_of

    if source.config is None:
        raise GenerateError(f"{source.path}: an export folder holds no training data; run the "
                            f"check on the run folder it was exported from")
    data = source.config["data"]
    s = source.schema
    cols = {"text": [s.text_field], "chat": [s.messages_field],
            "instruction": [s.prompt_field, s.response_field]}[s.mode]
    try:
        ds = load_records(path=data.get("path"), dataset=data.get("dataset"), format=data.get("format") or "auto",
                          split=data.get("split") or "train", config_name=data.get("config_name"),
                          columns=cols, text_split=data.get("text_split") or "file")
    except (OSError, ValueError) as e:
        raise GenerateError(f"{source.path}/config.yaml: data.path {data.get('path')!r}: the "
                            f"training data cannot be read for the check ({e})") from None
    return [" ".join(texts_of(r, s)) for r in ds]


def canary_check(source: ModelSource, synth_texts: list[str], synth: Corpus, tokenizer) -> dict | None:
    """The audit's input canaries of the run (None: the run had none)."""
    from llmdp.audit.canaries import load_canaries

    if source.config is None:
        return None
    path = os.path.join(source.path, "audit", "canaries.jsonl")
    if not os.path.isfile(path):
        return None
    can = load_canaries(path)
    texts = [tokenizer.decode([int(t) for t in row], skip_special_tokens=True).strip() for row in can.rows]
    joined = "\n".join(synth_texts)
    reproduced = np.array([bool(t) and t in joined for t in texts], dtype=bool)
    longest = overlap(synth, Corpus([r.tolist() for r in can.rows]), k=8)["longest_shared_tokens"]
    inc = np.asarray(can.included, dtype=bool)
    return {"canaries": can.m, "reproduced": int(reproduced.sum()),
            "reproduced_included": int((reproduced & inc).sum()),
            "reproduced_left_out": int((reproduced & ~inc).sum()),
            "longest_shared_tokens": longest,
            "note": "a canary left out by its coin was never trained on: its reproduction rate is "
                    "the chance level to compare the included ones with"}


def check(source: ModelSource, records: list[dict], tokenizer, *, k: int = 8,
          baseline_records: list[dict] | None = None, baseline_run: str | None = None) -> dict:
    from llmdp.synthetic.stats import texts_of

    train = Corpus(tokenize(training_texts(source), tokenizer))
    texts = [" ".join(texts_of(r, source.schema)) for r in records]
    synth = Corpus(tokenize(texts, tokenizer))
    out = {"internal": BANNER, "run_id": source.run_id, "training_records": len(train.docs),
           "dp_model": overlap(synth, train, k)}
    if baseline_records is not None:
        btexts = [" ".join(texts_of(r, source.schema)) for r in baseline_records]
        out["non_private_baseline"] = {"run": os.path.basename(str(baseline_run)),
                                       **overlap(Corpus(tokenize(btexts, tokenizer)), train, k)}
    canaries = canary_check(source, texts, synth, tokenizer)
    if canaries is not None:
        out["canaries"] = canaries
    return out


def baseline_samples(run_dir: str, schema: Schema, settings, batch_size: int = 16) -> list[dict]:
    """The same settings sampled from a NON-PRIVATE baseline's model (internal only)."""
    from llmdp.record.rundir import RunDir
    from llmdp.synthetic.sampling import records_for
    from llmdp.synthetic.source import load_model

    rd = RunDir(run_dir)
    if not rd.exists() or not os.path.isdir(rd.file("model")):
        raise GenerateError(f"--baseline {run_dir}: not a finished run folder (plan.json and model/)")
    if (rd.config().get("privacy") or {}).get("dp") is not False:
        raise GenerateError(f"--baseline {run_dir}: privacy.dp is not false; the comparison is with "
                            f"the NON-PRIVATE baseline of the same recipe (privacy.dp=false)")
    model, tok = load_model(rd.file("model"))
    out: list[dict] = []
    for s in range(0, settings.num_records, batch_size):
        out += records_for(model, tok, schema, settings,
                           list(range(s, min(s + batch_size, settings.num_records))))
    return out


def render(result: dict) -> str:
    lines = [result["internal"]]
    for key, what in (("dp_model", "DP model"), ("non_private_baseline", "NON-PRIVATE baseline")):
        r = result.get(key)
        if r:
            lines.append(f"{what}: longest token substring shared with the training data "
                         f"{r['longest_shared_tokens']}; {r['k']}-gram match rate "
                         f"{r['kgram_match_rate']:.4f}; records with a {r['k']}-gram match "
                         f"{r['records_with_kgram_match']}/{r['records']}")
    c = result.get("canaries")
    if c:
        lines.append(f"canaries: {c['reproduced']} of {c['canaries']} reproduced verbatim "
                     f"({c['reproduced_included']} included, {c['reproduced_left_out']} left out); "
                     f"longest token run shared with a canary {c['longest_shared_tokens']}")
    return "\n".join(lines)


def write(path: str, result: dict) -> None:
    from llmdp._fs import atomic_write

    atomic_write(path, lambda f: json.dump(result, f, indent=2), text=True)
