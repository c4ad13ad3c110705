"""Compression of the private demo tokenizer against non-private ones of the same size.

    python benchmarks/tokenizer.py [--epsilons 1,2,4] [--max-words 64,128] [--vocab-size 2048]

Trains, on the demo's private corpus (5,000 synthetic clinical notes; document units):
a NON-private SentencePiece on exact word counts (`privacy.dp: false`) and a DP one for
every (epsilon, K) asked, all of `--vocab-size` pieces, plus the shipped public byte-level
BPE (`tokenizers/demo-public`, trained on a generated public corpus) for reference. Then
encodes held-out notes (the same generator with another seed: other patients, other
notes) and prints tokens per word (whitespace words; lower is better), bytes per token,
and the ratio to the non-private tokenizer.

The DP tokenizers here are measurements, not releases: their ledger is a temporary file
that is deleted with them (a real release goes through `llmdp tokenizer train`, which
records it in the dataset's ledger).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def heldout_texts(num: int, seed: int) -> list[str]:
    from llmdp.data.synthetic import generate_clinical_notes

    return [r["text"] for r in generate_clinical_notes(num, seed)]


def compression(tokenizer, texts: list[str]) -> dict:
    words = sum(len(t.split()) for t in texts)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    return {"tokens_per_word": tokens / words, "bytes_per_token": nbytes / tokens,
            "tokens": tokens, "words": words}


def train(recipe: dict, log) -> tuple[str, dict]:
    from llmdp.config.schema import tokenizer_recipe_from_dict
    from llmdp.tokenizer.train import train_tokenizer

    cfg = tokenizer_recipe_from_dict(recipe, base_dir=REPO)
    info = train_tokenizer(cfg, log=log)
    return cfg.out_dir, info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epsilons", default="1,2,4", help="epsilon_tok values (comma-separated)")
    ap.add_argument("--max-words", default="64,128", help="K values (comma-separated)")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"))
    ap.add_argument("--num-documents", type=int, default=5000, help="private corpus size")
    ap.add_argument("--heldout", type=int, default=500, help="held-out notes")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    log = print if a.verbose else (lambda *_: None)
    texts = heldout_texts(a.heldout, seed=1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="llmdp-tokbench-") as tmp:
        corpus = os.path.join(REPO, ".cache", "llmdp", "demo", "clinical_notes.jsonl")
        if a.num_documents != 5000:
            corpus = os.path.join(tmp, "notes.jsonl")
        base = {
            "data": {"path": corpus, "text_field": "text", "unit": "document",
                     "synthetic": {"kind": "clinical_notes", "num_documents": a.num_documents, "seed": 0}},
            "tokenizer": {"model_type": a.model_type, "vocab_size": a.vocab_size},
            "output": {"dir": os.path.join(tmp, "out")},
        }
        t0 = time.perf_counter()
        path, info = train({**base, "privacy": {"dp": False},
                            "output": {**base["output"], "name": "non-private"}}, log)
        ref = compression(AutoTokenizer.from_pretrained(path), texts)
        rows.append({"tokenizer": "non-private SentencePiece (exact counts)", "epsilon": None,
                     "K": None, "released_words": info["released_words"],
                     "vocab": info["vocab_size_actual"], **ref, "seconds": time.perf_counter() - t0})
        pub = AutoTokenizer.from_pretrained(os.path.join(REPO, "tokenizers", "demo-public"))
        rows.append({"tokenizer": "public byte-level BPE (tokenizers/demo-public)", "epsilon": None,
                     "K": None, "released_words": None, "vocab": len(pub), **compression(pub, texts),
                     "seconds": None})
        for k in [int(x) for x in a.max_words.split(",")]:
            for eps in [float(x) for x in a.epsilons.split(",")]:
                t0 = time.perf_counter()
                name = f"dp-eps{eps:g}-k{k}"
                path, info = train({**base, "privacy": {"target_epsilon": eps, "max_words_per_unit": k,
                                                         "ledger": os.path.join(tmp, "ledger.jsonl")},
                                    "output": {**base["output"], "name": name}}, log)
                c = compression(AutoTokenizer.from_pretrained(path), texts)
                rows.append({"tokenizer": "DP SentencePiece", "epsilon": info["privacy"]["epsilon"],
                             "delta": info["privacy"]["delta"], "K": k,
                             "released_words": info["released_words"], "vocab": info["vocab_size_actual"],
                             **c, "seconds": time.perf_counter() - t0})
    print(f"held-out: {a.heldout} notes, {ref['words']} words; vocab size asked {a.vocab_size} "
          f"({a.model_type}); private corpus {a.num_documents} notes, document units")
    print(f"{'tokenizer':<48} {'eps_tok':>8} {'K':>5} {'words':>7} {'vocab':>6} "
          f"{'tok/word':>9} {'bytes/tok':>9} {'vs non-private':>14} {'time s':>7}")
    for r in rows:
        eps = f"{r['epsilon']:.3f}" if r["epsilon"] is not None else "-"
        k = str(r["K"]) if r["K"] is not None else "-"
        words = str(r["released_words"]) if r["released_words"] is not None else "-"
        secs = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
        print(f"{r['tokenizer']:<48} {eps:>8} {k:>5} {words:>7} {r['vocab']:>6} "
              f"{r['tokens_per_word']:>9.3f} {r['bytes_per_token']:>9.3f} "
              f"{r['tokens_per_word'] / ref['tokens_per_word']:>13.3f}x {secs:>7}")
    if a.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
