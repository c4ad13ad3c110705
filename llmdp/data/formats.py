"""How one record becomes tokens, and which of them the model is trained to predict.

Three record shapes (``RecordEncoder.mode``):

- ``"text"``: one string column (``data.text_field``). Every token is a training target.
- ``"chat"``: one column (``data.messages_field``) holding a list of
  ``{"role": ..., "content": ...}`` messages. Only the assistant replies are targets.
- ``"instruction"``: two string columns (``data.prompt_field``, ``data.response_field``),
  encoded exactly as the chat ``[{"role": "user", "content": prompt},
  {"role": "assistant", "content": response}]``.

Output of :meth:`RecordEncoder.encode_batch`, one pair per record, in order:
``ids`` (int32 [n]) and ``target`` (bool [n]). ``ids`` is the rendered record followed by
one EOS; the tokenizer is always called with ``add_special_tokens=False`` (no BOS), so
special tokens appear only where the chat template writes them as text. ``target[t]``
says whether token ``t`` is one the model is trained to predict (its loss counts), so a
packer / loss turns ``target`` into labels; what comes before a target token is context.

- text: ``ids = tokenizer(text)["input_ids"] + [eos]``; ``target`` all True (EOS included,
  so the model learns where a document ends). One tokenizer call per batch.
- chat / instruction with a chat template (the tokenizer's own, or ``chat_template`` given
  as Jinja text): the conversation is rendered with ``apply_chat_template(tokenize=False)``
  and tokenized once, with offsets. ``target`` is True on the tokens of every assistant
  message's content and of the end-of-turn marker the template writes right after it
  (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ..., trailing whitespace excluded); False on
  system / user / tool turns, role headers and other template text. A token whose
  characters straddle the edge of an assistant span (a BPE merge of template text with the
  first or last reply character) counts as a target, so no reply character is left out.
  The final EOS is a target iff the conversation ends with an assistant message; it is not
  appended when the rendering already ends with the EOS token.
- chat / instruction without a template (``chat_template="none"``, or ``"auto"`` and the
  tokenizer has none): the plain format :data:`PLAIN_FORMAT`, one line per message::

      System: {content}\\n
      User: {content}\\n
      Assistant: {content}\\n

  (other roles: the role name capitalized). Text is tokenized segment by segment, so the
  mask is exact: targets are the assistant ``{content}\\n`` (the newline is its end-of-turn
  marker) and the final EOS when the last message is the assistant's. (Tokenizers that
  prepend a space to every call, like SentencePiece's, do so at each segment start.)

Finding assistant spans in a template's output: for assistant message ``i`` the encoder
renders the prefix ``messages[:i]`` with ``add_generation_prompt=True`` and the prefix
``messages[:i+1]``; when each is a prefix of the next and of the whole rendering, the reply
lies between them (the content, then the end-of-turn marker). Templates that render a
turn differently depending on what follows (e.g. reasoning blocks only on the last turn)
fall back to locating each message's content in order in the full rendering (followed by
the template's end-of-turn text, probed once; an empty reply gets no target there). If neither
works (a template that rewrites the content), ``encode_batch`` raises ``ValueError``.

A record with empty / None text still encodes (to ``[eos]``); a chat without an assistant
message (or with no messages) encodes with no target token and is counted in
``num_records_without_target`` so callers can report or drop it.

Malformed records are found before encoding by :meth:`RecordEncoder.record_problems` (a
missing or non-string text / prompt / response, an empty text or response, a chat that is
not a list of ``{role, content}`` messages or has a role outside :data:`KNOWN_ROLES`), so
that the caller refuses or skips them (``data.on_bad_record``) instead of encoding them
into something else: a number is never turned into text, a missing text never into an
EOS-only unit, a misspelt role never into a record without targets.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np

FORMATS_VERSION = 1
PLAIN_FORMAT = "plain-v1: '{Role}: {content}\\n' per message (System/User/Assistant)"
ASSISTANT = "assistant"
# Roles chat templates know; any other (a typo like "assitant") is a malformed record.
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
_PROBE_USER = "llmdp-probe-user-7d1f"
_PROBE_ASSISTANT = "llmdp-probe-assistant-3a9c"


def _field(name: str, value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty column name or unset, got {value!r}")
    return value


def _plain_header(role: str) -> str:
    return f"{role[:1].upper()}{role[1:]}: "


class RecordEncoder:
    """Turns batches of records into (token ids, target mask) pairs. See the module doc.

    ``chat_template``: ``"auto"`` (the tokenizer's ``chat_template`` if it has one, else
    the plain format), ``"none"`` (always the plain format) or a Jinja template string.
    Counters over all ``encode_batch`` calls: ``num_records``, ``num_tokens``,
    ``num_target_tokens``, ``num_records_without_target`` (see :meth:`stats`).
    """

    def __init__(self, tokenizer, *, text_field: str = "text", messages_field: str | None = None,
                 prompt_field: str | None = None, response_field: str | None = None,
                 chat_template: str | None = "auto"):
        self.tokenizer = tokenizer
        self.text_field = _field("data.text_field", text_field)
        self.messages_field = _field("data.messages_field", messages_field)
        self.prompt_field = _field("data.prompt_field", prompt_field)
        self.response_field = _field("data.response_field", response_field)
        if self.messages_field is not None and (prompt_field is not None or response_field is not None):
            raise ValueError(
                f"data.messages_field={messages_field!r} cannot be combined with "
                f"data.prompt_field={prompt_field!r} / data.response_field={response_field!r}: set "
                "either data.messages_field (chat records) or both data.prompt_field and "
                "data.response_field (instruction records)"
            )
        if (prompt_field is None) != (response_field is None):
            raise ValueError(
                f"data.prompt_field={prompt_field!r} and data.response_field={response_field!r} "
                "go together: set both for instruction records (or data.messages_field for chat)"
            )
        if prompt_field is not None and prompt_field == response_field:
            raise ValueError(
                f"data.prompt_field and data.response_field are both {prompt_field!r}; they must "
                "name two different columns"
            )
        if self.messages_field is not None:
            self.mode = "chat"
            self.column_fields = {"data.messages_field": self.messages_field}
        elif self.prompt_field is not None:
            self.mode = "instruction"
            self.column_fields = {"data.prompt_field": self.prompt_field,
                                  "data.response_field": self.response_field}
        else:
            if self.text_field is None:
                raise ValueError("data.text_field must name the text column (or set "
                                 "data.messages_field / data.prompt_field + data.response_field)")
            self.mode = "text"
            self.column_fields = {"data.text_field": self.text_field}

        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError(
                f"the tokenizer ({type(tokenizer).__name__}) has no EOS token; records are "
                "closed by EOS"
            )
        self.eos_id = int(eos)

        # Which template renders chats: None = plain format; else the text to hash and the
        # argument to pass (None = the tokenizer's own, possibly a dict of named templates).
        self.template_source = "none"
        self.template_text = None
        self._template_arg = None
        if chat_template in (None, "auto"):
            own = getattr(tokenizer, "chat_template", None)
            if own:
                self.template_source, self.template_text = "tokenizer", own
        elif chat_template == "none":
            pass
        elif isinstance(chat_template, str) and ("{{" in chat_template or "{%" in chat_template):
            self.template_source = "recipe"
            self.template_text = self._template_arg = chat_template
        else:
            raise ValueError(
                f"data.chat_template={chat_template!r} must be 'auto' (the tokenizer's template "
                "if any), 'none' (the plain 'User: ...' format) or a Jinja chat template"
            )
        if self.mode != "text" and self.template_text is not None and not getattr(
            tokenizer, "is_fast", False
        ):
            raise ValueError(
                f"chat records with a chat template need a fast tokenizer (character offsets); "
                f"{type(tokenizer).__name__} is not one. Load the fast tokenizer, or set "
                "data.chat_template='none' to use the plain format"
            )
        self._end_marker: str | None = None  # the template's end-of-turn text (fallback only)
        self.reset_stats()

    # ------------------------------------------------------------------ description

    @property
    def columns(self) -> list[str]:
        """The record columns ``encode_batch`` reads."""
        return list(self.column_fields.values())

    def describe(self) -> dict:
        """The encoding configuration: mode, columns, EOS id, template source and hash."""
        d = {"version": FORMATS_VERSION, "mode": self.mode, "eos_id": self.eos_id,
             "columns": dict(self.column_fields)}
        if self.mode != "text":
            d["chat_template"] = self.template_source
            if self.template_text is None:
                d["plain_format"] = PLAIN_FORMAT
            else:
                text = json.dumps(self.template_text, sort_keys=True)
                d["template_sha256"] = hashlib.sha256(text.encode()).hexdigest()
        return d

    def fingerprint(self) -> str:
        """sha256 (hex) of :meth:`describe` as canonical JSON: equal iff the encodings are."""
        text = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def reset_stats(self) -> None:
        self.num_records = 0
        self.num_tokens = 0
        self.num_target_tokens = 0
        self.num_records_without_target = 0

    def stats(self) -> dict:
        return {"num_records": self.num_records, "num_tokens": self.num_tokens,
                "num_target_tokens": self.num_target_tokens,
                "num_records_without_target": self.num_records_without_target}

    # ------------------------------------------------------------------ validation

    def record_problems(self, batch: Mapping[str, list]) -> list[tuple[int, str, str]]:
        """``[(k, field, what is wrong)]`` for each malformed record ``k`` of the batch;
        ``field`` is the recipe field and its column, e.g. ``data.text_field='text'``."""
        out = []
        fields = {col: f"{field}={col!r}" for field, col in self.column_fields.items()}
        for col in self.columns:
            values = batch.get(col)
            if values is None:  # the column is absent from the whole batch
                n = len(next(iter(batch.values()))) if batch else 0
                out.extend((k, fields[col], "is missing") for k in range(n))
                continue
            for k, v in enumerate(values):
                why = (self._chat_problem(v) if self.mode == "chat"
                       else _text_problem(v, empty_ok=col == self.prompt_field))
                if why is not None:
                    out.append((k, fields[col], why))
        return sorted(out)

    @staticmethod
    def _chat_problem(messages) -> str | None:
        if messages is None:
            return "is missing"
        if isinstance(messages, (str, bytes, Mapping)) or not hasattr(messages, "__iter__"):
            return f"holds a {type(messages).__name__}, not a list of {{'role', 'content'}} messages"
        messages = list(messages)
        if not messages:
            return "is an empty list of messages"
        for j, m in enumerate(messages):
            if not isinstance(m, Mapping):
                return f"message {j} is a {type(m).__name__}, not a {{'role', 'content'}} dict"
            role = m.get("role")
            if not isinstance(role, str):
                return f"message {j} has no string 'role' (got {role!r})"
            if role not in KNOWN_ROLES:
                return f"message {j} has role {role!r}, not one of {list(KNOWN_ROLES)}"
            content = m.get("content")
            if content is not None and not isinstance(content, str):
                return (f"message {j} has content of type {type(content).__name__}, not a string "
                        "(structured / multimodal content is not supported)")
        return None

    # ------------------------------------------------------------------ encoding

    def encode_batch(self, batch: Mapping[str, list]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``[(ids int32 [n], target bool [n]) for each record]`` of a dict-of-columns batch."""
        for field, col in self.column_fields.items():
            if col not in batch:
                raise ValueError(
                    f"{field}={col!r} is not a column of the batch; available: {sorted(batch)}"
                )
        if self.mode == "text":
            out = self._encode_text(batch[self.text_field])
        else:
            if self.mode == "chat":
                chats = [self._messages(m, k) for k, m in enumerate(batch[self.messages_field])]
            else:
                chats = [
                    [{"role": "user", "content": _text(p)},
                     {"role": ASSISTANT, "content": _text(r)}]
                    for p, r in zip(batch[self.prompt_field], batch[self.response_field], strict=True)
                ]
            if self.template_text is None:
                out = self._encode_plain(chats)
            else:
                out = self._encode_template(chats)
        for ids, target in out:
            self.num_records += 1
            self.num_tokens += int(ids.size)
            n_target = int(target.sum())
            self.num_target_tokens += n_target
            self.num_records_without_target += int(n_target == 0)
        return out

    def _encode_text(self, texts) -> list[tuple[np.ndarray, np.ndarray]]:
        texts = [_text(t) for t in texts]
        if not texts:
            return []
        enc = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        out = []
        for ids in enc:
            n = len(ids)
            arr = np.empty(n + 1, dtype=np.int32)
            arr[:n] = ids
            arr[n] = self.eos_id
            out.append((arr, np.ones(n + 1, dtype=bool)))
        return out

    def _messages(self, messages, k: int) -> list[dict]:
        if messages is None:
            return []
        if isinstance(messages, (str, bytes)) or not hasattr(messages, "__iter__"):
            raise ValueError(
                f"data.messages_field={self.messages_field!r}: record {k} of the batch holds "
                f"{type(messages).__name__}, not a list of {{'role', 'content'}} messages"
            )
        out = []
        for m in messages:
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ValueError(
                    f"data.messages_field={self.messages_field!r}: record {k} of the batch has a "
                    f"message that is not a {{'role': str, 'content': str}} dict: {m!r}"
                )
            content = m.get("content")
            if content is not None and not isinstance(content, str):
                raise ValueError(
                    f"data.messages_field={self.messages_field!r}: record {k}: message content "
                    f"must be a string (got {type(content).__name__}); structured / multimodal "
                    "content is not supported"
                )
            out.append({"role": m["role"], "content": _text(content)})
        return out

    # plain format -------------------------------------------------------------

    def _encode_plain(self, chats: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
        # Segments of equal target flag are merged so the text is split only where the
        # flag changes; one tokenizer call for all segments of the batch.
        per_record: list[list[tuple[str, bool]]] = []
        for msgs in chats:
            segs: list[tuple[str, bool]] = []
            for m in msgs:
                is_reply = m["role"] == ASSISTANT
                _push(segs, _plain_header(m["role"]), False)
                _push(segs, m["content"] + "\n", is_reply)
            per_record.append(segs)
        flat = [s for segs in per_record for s, _ in segs]
        enc = self.tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
        out, j = [], 0
        for msgs, segs in zip(chats, per_record, strict=True):
            ids_parts, tgt_parts = [], []
            for _, flag in segs:
                ids_parts.append(np.asarray(enc[j], dtype=np.int32))
                tgt_parts.append(np.full(len(enc[j]), flag, dtype=bool))
                j += 1
            ends_with_reply = bool(msgs) and msgs[-1]["role"] == ASSISTANT
            ids_parts.append(np.array([self.eos_id], dtype=np.int32))
            tgt_parts.append(np.array([ends_with_reply]))
            out.append((np.concatenate(ids_parts), np.concatenate(tgt_parts)))
        return out

    # chat template --------------------------------------------------------------

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=self._template_arg,
        )
        if not isinstance(text, str):
            raise ValueError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def _encode_template(self, chats: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
        texts, spans = [], []
        for msgs in chats:
            if not msgs:
                texts.append("")
                spans.append([])
                continue
            full = self._render(msgs)
            texts.append(full)
            spans.append(self._assistant_spans(msgs, full))
        enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for msgs, ids, offsets, sp in zip(chats, enc["input_ids"], enc["offset_mapping"], spans,
                                          strict=True):
            ids = np.asarray(ids, dtype=np.int32)
            off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
            target = np.zeros(ids.size, dtype=bool)
            for a, b in sp:  # a token is a target iff its characters overlap [a, b)
                target |= (off[:, 0] < b) & (off[:, 1] > a)
            if not (ids.size and ids[-1] == self.eos_id):
                ends_with_reply = bool(msgs) and msgs[-1]["role"] == ASSISTANT
                ids = np.append(ids, np.int32(self.eos_id))
                target = np.append(target, ends_with_reply)
            out.append((ids, target))
        return out

    def _assistant_spans(self, msgs: list[dict], full: str) -> list[tuple[int, int]]:
        """Character spans [start, end) of every assistant reply (+ its end marker) in ``full``."""
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != ASSISTANT:
                continue
            span = self._span_by_prefix(msgs, i, full)
            if span is None:
                return self._spans_in_order(msgs, full)
            spans.append(span)
        return spans

    def _span_by_prefix(self, msgs, i, full) -> tuple[int, int] | None:
        if i == 0:
            return None  # no prefix to render (templates refuse an empty conversation)
        try:
            before = self._render(msgs[:i], add_generation_prompt=True)
            upto = self._render(msgs[: i + 1])
        except Exception:  # e.g. a template that rejects a conversation ending this way
            return None
        if not (upto.startswith(before) and full.startswith(upto)):
            return None
        region = upto[len(before):]
        found = _find_content(region, msgs[i]["content"], 0)
        if found is None:
            return None
        j, n = found
        marker = region[j + n:].rstrip()  # the end-of-turn text right after the reply
        return len(before) + j, len(before) + j + n + len(marker)

    def _template_end_marker(self) -> str:
        """The text the template writes right after an assistant reply (probed once)."""
        if self._end_marker is None:
            self._end_marker = ""
            try:
                text = self._render([{"role": "user", "content": _PROBE_USER},
                                     {"role": ASSISTANT, "content": _PROBE_ASSISTANT}])
                k = text.find(_PROBE_ASSISTANT)
                if k >= 0:
                    self._end_marker = text[k + len(_PROBE_ASSISTANT):].rstrip()
            except Exception:
                pass
        return self._end_marker

    def _spans_in_order(self, msgs: list[dict], full: str) -> list[tuple[int, int]]:
        """Fallback: find every message's content in ``full``, in order."""
        spans, cursor = [], 0
        marker = self._template_end_marker()
        for k, m in enumerate(msgs):
            found = _find_content(full, m["content"], cursor)
            if m["role"] != ASSISTANT:
                if found is not None and m["content"]:
                    cursor = found[0] + found[1]
                continue
            if not m["content"].strip():
                continue  # an empty reply has no position of its own to find: no target
            if found is None:
                raise ValueError(
                    f"cannot find assistant message {k} in the chat template's output: the "
                    f"template ({self.template_source}) neither renders conversation prefixes "
                    "consistently (prefix up to a reply + generation prompt, then the reply) nor "
                    "writes the message content verbatim, so the tokens to train on cannot be "
                    "located. Use a template that writes message['content'] as is, or set "
                    "data.chat_template='none' for the plain 'User: ...' format"
                )
            j, n = found
            end = j + n
            if marker and full.startswith(marker, end):
                end += len(marker)
            spans.append((j, end))
            cursor = end
        return spans


def _text_problem(value, *, empty_ok: bool = False) -> str | None:
    if value is None:
        return "is missing (or null)"
    if not isinstance(value, str):
        return f"holds a {type(value).__name__} ({value!r:.40}), not a string"
    if not empty_ok and not value.strip():
        return "is empty"
    return None


def _text(value) -> str:
    return "" if value is None else str(value)


def _push(segs: list[tuple[str, bool]], text: str, flag: bool) -> None:
    if segs and segs[-1][1] == flag:
        segs[-1] = (segs[-1][0] + text, flag)
    else:
        segs.append((text, flag))


def _find_content(text: str, content: str, start: int) -> tuple[int, int] | None:
    """(position, length) of ``content`` in ``text`` from ``start``; templates often trim it."""
    if text.startswith(content, start):
        return start, len(content)
    k = text.find(content, start) if content else -1
    if k >= 0:
        return k, len(content)
    stripped = content.strip()
    if stripped and stripped != content:
        k = text.find(stripped, start)
        if k >= 0:
            return k, len(stripped)
    return None
