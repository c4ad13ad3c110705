"""`llmdp data preview RECIPE`: the first few privacy units of a recipe, rendered with their
loss masks, on the user's own console.

What it shows is what training would build: the recipe's tokenizer, record encoder (plain
text, chat template, prompt/response) and privacy unit (`llmdp.data.units`), applied to the
first records of the corpus. Each row is decoded in runs of trained and masked tokens: a
trained token is one the row's loss predicts (a target, and not the row's first token,
which nothing predicts); a masked one is context only (a prompt, a user turn, the template's
markers). ``--raw`` adds the token ids.

Which units: sequence and document units are built from a prefix of the records, exactly
as the full build makes its first units (a sequence row cut short by the end of the prefix
is left out); user units from every record of the first users met in the data (a user's
unit depends on that user's records only). Before ``data.unit_fraction`` and the held-out
split (``data.eval``), which drop or move units by a keyed hash: a unit shown may be one
that training leaves out or evaluates.

Privacy: this prints private records in clear to the console that asked, and nothing else:
nothing is written to a run directory, a ledger, a report or any file meant to leave (the
records are read through the same cached loaders as training). It is not a release and costs
no budget; do not paste its output anywhere that is published.
"""

from __future__ import annotations

import os
import sys

import numpy as np

__all__ = ["preview", "render_row"]

_GREEN, _DIM, _RESET = "\x1b[32m", "\x1b[2m", "\x1b[0m"
MASK_OPEN, MASK_CLOSE = "[[", "]]"  # around masked text without colors


def render_row(tokenizer, tokens: np.ndarray, target: np.ndarray, *, color: bool) -> str:
    """A row decoded in runs of trained / masked tokens (module docstring): trained in
    green and masked dimmed with ``color``, else masked runs between ``[[`` and ``]]``."""
    trained = np.asarray(target, dtype=bool).copy()
    if trained.size:
        trained[0] = False  # the row's first token is never a target
    out, start = [], 0
    for i in range(1, trained.size + 1):
        if i == trained.size or trained[i] != trained[start]:
            text = tokenizer.decode([int(t) for t in tokens[start:i]], skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False)
            if color:
                out.append((_GREEN if trained[start] else _DIM) + text + _RESET)
            else:
                out.append(text if trained[start] else MASK_OPEN + text + MASK_CLOSE)
            start = i
    return "".join(out)


def _raw_row(tokens: np.ndarray, target: np.ndarray) -> str:
    trained = np.asarray(target, dtype=bool).copy()
    if trained.size:
        trained[0] = False
    return " ".join(str(int(t)) if k else f"({int(t)})" for t, k in zip(tokens, trained))


def _records(cfg, encoder, spec, want: int):
    """(the encoded units of the first records, whether they are the whole corpus)."""
    from llmdp.data.encode import check_records, encode_records
    from llmdp.data.files import record_location
    from llmdp.data.sources import load_records
    from llmdp.data.units import build_units

    d = cfg.data
    columns = dict(encoder.column_fields)
    if spec.kind == "user":
        columns["data.user_field"] = spec.user_field
    ds = load_records(path=d.path, dataset=d.dataset, format=d.format, split=d.split,
                      config_name=d.config_name, columns=columns, text_split=d.text_split)
    locate = record_location(path=d.path, dataset=d.dataset, format=d.format,
                             text_split=d.text_split, split=d.split)
    n = len(ds)
    if spec.kind == "user":  # every record of the first `want` users met
        chosen: list = []
        for u in ds[spec.user_field]:
            if u not in chosen and u is not None and u == u and u != "":
                chosen.append(u)
                if len(chosen) == want:
                    break
        picks = [[i for i, u in enumerate(ds[spec.user_field]) if u in chosen]]
    else:  # growing prefixes until `want` whole units (a sequence row may be cut short)
        picks, k = [], max(4 * want, 16)
        while True:
            picks.append(list(range(min(k, n))))
            if k >= n:
                break
            k *= 4
    for idx in picks:
        sub = ds.select(idx)
        sub, _ = check_records(sub, encoder, spec, d.on_bad_record, lambda i, idx=idx: locate(idx[i]))
        units = build_units(encode_records(sub, encoder, spec, num_proc=1, progress=False), spec)
        whole = len(idx) == n
        usable = units.num_units - (1 if spec.kind == "sequence" and not whole else 0)
        if usable >= want or whole or spec.kind == "user":
            return units, usable
    raise AssertionError("unreachable: the last prefix is the whole corpus")  # pragma: no cover


def preview(cfg, num_units: int = 3, *, raw: bool = False, color: bool | None = None,
            write=print) -> int:
    """Print the first ``num_units`` units of ``cfg`` (module docstring); returns how many
    were shown. ``color``: None = when the output is a terminal."""
    from llmdp.data.formats import RecordEncoder
    from llmdp.data.synthetic import ensure_clinical_notes
    from llmdp.data.units import UnitSpec
    from llmdp.train.models import load_tokenizer

    if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
        raise ValueError(f"--units {num_units!r}: the number of units to show must be at least 1")
    if color is None:
        color = sys.stdout.isatty() and os.environ.get("NO_COLOR") is None
    d, m = cfg.data, cfg.model
    if d.synthetic is not None and not os.path.exists(d.path):
        ensure_clinical_notes(d.path, d.synthetic.num_documents, d.synthetic.seed)
    own = m.tokenizer not in (None, m.name_or_path)
    tokenizer = load_tokenizer(m.tokenizer or m.name_or_path,
                               "model.tokenizer" if own else "model.name_or_path")
    spec = UnitSpec(kind=d.unit, sequence_length=d.sequence_length,
                    max_rows_per_unit=1 if d.unit == "sequence" else d.max_rows_per_unit,
                    document_masking=d.document_masking,
                    user_field=d.user_field if d.unit == "user" else None)
    encoder = RecordEncoder(tokenizer, text_field=d.text_field, messages_field=d.messages_field,
                            prompt_field=d.prompt_field, response_field=d.response_field,
                            chat_template=d.chat_template)
    units, usable = _records(cfg, encoder, spec, num_units)
    shown = min(num_units, usable)
    write("llmdp data preview: PRIVATE records, printed on this console only (nothing is "
          "written); do not publish this output.")
    write(f"encoding: {encoder.describe()}; unit: {spec.describe()}")
    write(f"the first {shown} unit(s), before data.unit_fraction and the held-out split. "
          + ("Trained tokens in green, masked (context only) dimmed." if color else
             f"Masked tokens (context only, no loss) are between {MASK_OPEN} and {MASK_CLOSE}; "
             "the rest is trained."))
    lengths = units.row_lengths()
    for u in range(shown):
        r0, nr = int(units.row_start[u]), int(units.row_count[u])
        trained = int(units.unit_target_tokens()[u])
        write("")
        write(f"--- unit {u + 1}: {nr} row(s), {int(lengths[r0:r0 + nr].sum())} tokens, "
              f"{trained} trained")
        for r in range(r0, r0 + nr):
            s, e = int(units.row_offsets[r]), int(units.row_offsets[r + 1])
            if nr > 1:
                write(f"[row {r - r0 + 1}]")
            write(render_row(tokenizer, units.tokens[s:e], units.target[s:e], color=color))
            if raw:
                write("ids (masked in parentheses): " + _raw_row(units.tokens[s:e], units.target[s:e]))
    if shown < num_units:
        write("")
        write(f"(the corpus has {shown} unit(s) of this kind)")
    return shown
