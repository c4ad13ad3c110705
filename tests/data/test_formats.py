import numpy as np
import pytest

from llmdp.data.formats import RecordEncoder
from tests.data._chat_helpers import (
    CHATML,
    COUNTING_CHATML,
    LLAMA3_LIKE,
    MISTRAL_LIKE,
    SHOUTING,
    chat_tokenizer,
    target_runs,
)
from tests.helpers import tiny_tokenizer

SYSTEM = "You are a careful clinical assistant."
USER1 = "Summarize the note for patient Alice Example."
REPLY1 = "Alice has hypertension, treated with lisinopril."
USER2 = "Any allergies?"
REPLY2 = "None recorded."

CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": USER1},
    {"role": "assistant", "content": REPLY1},
    {"role": "user", "content": USER2},
    {"role": "assistant", "content": REPLY2},
]


class CountingTokenizer:
    """Delegates to a tokenizer and counts its __call__s."""

    def __init__(self, tok):
        self._tok = tok
        self.calls = 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return self._tok(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _check_pair(ids, target):
    assert ids.dtype == np.int32 and target.dtype == np.bool_
    assert ids.shape == target.shape and ids.ndim == 1


# ---------------------------------------------------------------- text


def test_text_mode_ids_targets_and_one_call_per_batch():
    tok = tiny_tokenizer()
    counting = CountingTokenizer(tok)
    enc = RecordEncoder(counting)
    texts = ["first document about hypertension.", "", None, "a second, longer document."]
    out = enc.encode_batch({"text": texts, "other": [1, 2, 3, 4]})
    assert counting.calls == 1
    assert len(out) == 4
    for text, (ids, target) in zip(texts, out):
        _check_pair(ids, target)
        expected = tok(text or "", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ids.tolist() == expected
        assert target.all()
    assert out[1][0].tolist() == [tok.eos_token_id]  # empty and None still encode
    assert enc.mode == "text" and enc.columns == ["text"]
    assert enc.num_records == 4 and enc.num_records_without_target == 0
    assert enc.num_tokens == sum(ids.size for ids, _ in out) == enc.num_target_tokens


def test_text_mode_other_field_and_missing_column():
    tok = tiny_tokenizer()
    enc = RecordEncoder(tok, text_field="body")
    assert enc.columns == ["body"]
    ids, target = enc.encode_batch({"body": ["hello world"]})[0]
    assert ids.tolist() == tok("hello world", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with pytest.raises(ValueError, match=r"data\.text_field='body'.*available: \['text'\]"):
        enc.encode_batch({"text": ["x"]})
    assert enc.encode_batch({"body": []}) == []


# ---------------------------------------------------------------- chat with a template


@pytest.mark.parametrize("special_markers", [True, False])
def test_chat_targets_are_exactly_the_replies(special_markers):
    tok = chat_tokenizer(CHATML, special_markers=special_markers)
    enc = RecordEncoder(tok, messages_field="messages")
    assert enc.mode == "chat" and enc.columns == ["messages"]
    ids, target = enc.encode_batch({"messages": [CHAT]})[0]
    _check_pair(ids, target)
    rendered = tok.apply_chat_template(CHAT, tokenize=False)
    # ids: the template's rendering tokenized once, without added special tokens, + EOS.
    assert ids.tolist() == tok(rendered, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert target_runs(tok, ids, target) == [
        REPLY1 + "<|im_end|>", REPLY2 + "<|im_end|>", tok.eos_token
    ]
    context = tok.decode(ids[~target].tolist(), skip_special_tokens=False)
    for s in (SYSTEM, USER1, USER2):
        assert s in context
    assert enc.num_records_without_target == 0


def test_chat_single_turn_and_trailing_user_turn():
    tok = chat_tokenizer(CHATML)
    enc = RecordEncoder(tok, messages_field="m")
    one = [{"role": "user", "content": USER1}, {"role": "assistant", "content": REPLY1}]
    trailing = one + [{"role": "user", "content": USER2}]
    (ids1, t1), (ids2, t2) = enc.encode_batch({"m": [one, trailing]})
    assert target_runs(tok, ids1, t1) == [REPLY1 + "<|im_end|>", tok.eos_token]
    # The final EOS closes a user turn here: not a target.
    assert target_runs(tok, ids2, t2) == [REPLY1 + "<|im_end|>"]
    assert ids2[-1] == tok.eos_token_id and not t2[-1]


def test_llama3_like_template_trims_content():
    tok = chat_tokenizer(LLAMA3_LIKE)
    enc = RecordEncoder(tok, messages_field="messages")
    chat = [{"role": "user", "content": USER1}, {"role": "assistant", "content": "  " + REPLY1 + "\n"},
            {"role": "user", "content": USER2}, {"role": "assistant", "content": REPLY2}]
    ids, target = enc.encode_batch({"messages": [chat]})[0]
    assert ids[0] == tok.bos_token_id  # from the template text, not added by the tokenizer call
    assert target_runs(tok, ids, target) == [
        REPLY1 + "<|eot_id|>", REPLY2 + "<|eot_id|>" + tok.eos_token
    ]


def test_template_closing_replies_with_eos_gets_no_second_eos():
    tok = chat_tokenizer(MISTRAL_LIKE)
    enc = RecordEncoder(tok, messages_field="messages")
    chat = [m for m in CHAT if m["role"] != "system"]
    ids, target = enc.encode_batch({"messages": [chat]})[0]
    rendered = tok.apply_chat_template(chat, tokenize=False)
    assert rendered.endswith(tok.eos_token)
    assert ids.tolist() == tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.eos_token_id and ids[-2] != tok.eos_token_id
    eos = tok.eos_token
    assert target_runs(tok, ids, target) == [REPLY1 + eos, REPLY2 + eos]


def test_template_that_is_not_prefix_consistent_falls_back_to_search():
    tok = chat_tokenizer(COUNTING_CHATML)
    enc = RecordEncoder(tok, messages_field="messages")
    ids, target = enc.encode_batch({"messages": [CHAT]})[0]
    assert target_runs(tok, ids, target) == [
        REPLY1 + "<|im_end|>", REPLY2 + "<|im_end|>", tok.eos_token
    ]


QUOTING = "You said: How can I help? Then: None recorded. Is that so?"


def test_reply_first_and_reply_quoted_in_the_prompt():
    tok = chat_tokenizer(CHATML)
    enc = RecordEncoder(tok, messages_field="messages")
    chat = [{"role": "assistant", "content": "How can I help?"},
            {"role": "user", "content": QUOTING},
            {"role": "assistant", "content": REPLY2}]
    ids, target = enc.encode_batch({"messages": [chat]})[0]
    assert target_runs(tok, ids, target) == [
        "How can I help?<|im_end|>", REPLY2 + "<|im_end|>", tok.eos_token
    ]
    assert QUOTING in tok.decode(ids[~target].tolist(), skip_special_tokens=False)


def test_template_whose_spans_cannot_be_found_raises():
    tok = chat_tokenizer(SHOUTING, special_markers=False)
    enc = RecordEncoder(tok, messages_field="messages")
    with pytest.raises(ValueError, match=r"cannot find assistant message 2.*data\.chat_template='none'"):
        enc.encode_batch({"messages": [CHAT]})


def test_chat_without_reply_is_counted():
    tok = chat_tokenizer(CHATML)
    enc = RecordEncoder(tok, messages_field="messages")
    out = enc.encode_batch({"messages": [[{"role": "user", "content": USER1}], [], None, CHAT]})
    for ids, target in out[:3]:
        _check_pair(ids, target)
        assert not target.any() and ids[-1] == tok.eos_token_id
    assert out[1][0].tolist() == [tok.eos_token_id] == out[2][0].tolist()
    assert enc.num_records == 4 and enc.num_records_without_target == 3
    assert enc.stats()["num_target_tokens"] == int(out[3][1].sum()) > 0


def test_bad_messages_name_the_field():
    enc = RecordEncoder(chat_tokenizer(CHATML), messages_field="messages")
    with pytest.raises(ValueError, match=r"data\.messages_field='messages'.*record 0.*str"):
        enc.encode_batch({"messages": ["just a string"]})
    with pytest.raises(ValueError, match=r"data\.messages_field='messages'.*record 0"):
        enc.encode_batch({"messages": [[{"content": "no role"}]]})


# ---------------------------------------------------------------- instruction


@pytest.mark.parametrize("template", [CHATML, None])
def test_instruction_equals_chat(template):
    tok = chat_tokenizer(template)
    inst = RecordEncoder(tok, prompt_field="prompt", response_field="response")
    chat = RecordEncoder(tok, messages_field="messages")
    assert inst.mode == "instruction" and inst.columns == ["prompt", "response"]
    prompts, responses = [USER1, USER2, None], [REPLY1, REPLY2, "ok"]
    got = inst.encode_batch({"prompt": prompts, "response": responses})
    want = chat.encode_batch({"messages": [
        [{"role": "user", "content": p or ""}, {"role": "assistant", "content": r}]
        for p, r in zip(prompts, responses)
    ]})
    for (a, ta), (b, tb) in zip(got, want, strict=True):
        assert a.tolist() == b.tolist() and ta.tolist() == tb.tolist()
        assert ta.any()


# ---------------------------------------------------------------- plain format (no template)


@pytest.mark.parametrize("template, chat_template", [(None, "auto"), (CHATML, "none")])
def test_plain_format_mask_is_exact(template, chat_template):
    tok = chat_tokenizer(template)
    counting = CountingTokenizer(tok)
    enc = RecordEncoder(counting, messages_field="messages", chat_template=chat_template)
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (ids, target), (ids_s, target_s) = enc.encode_batch({"messages": [CHAT, short]})
    assert counting.calls == 1  # all segments of the batch in one call
    segments = [
        (f"System: {SYSTEM}\nUser: {USER1}\nAssistant: ", False), (REPLY1 + "\n", True),
        (f"User: {USER2}\nAssistant: ", False), (REPLY2 + "\n", True),
    ]
    want_ids, want_target = [], []
    for text, flag in segments:
        seg = tok(text, add_special_tokens=False)["input_ids"]
        want_ids += seg
        want_target += [flag] * len(seg)
    assert ids.tolist() == want_ids + [tok.eos_token_id]
    assert target.tolist() == want_target + [True]
    assert target_runs(tok, ids, target) == [REPLY1 + "\n", REPLY2 + "\n" + tok.eos_token]
    assert tok.decode(ids_s.tolist()) == "User: hi\nAssistant: hello\n" + tok.eos_token
    assert target_runs(tok, ids_s, target_s) == ["hello\n" + tok.eos_token]


# ---------------------------------------------------------------- configuration


def test_field_combinations_are_validated():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match=r"data\.messages_field='m'.*data\.prompt_field='p'"):
        RecordEncoder(tok, messages_field="m", prompt_field="p", response_field="r")
    with pytest.raises(ValueError, match=r"data\.prompt_field='p' and data\.response_field=None"):
        RecordEncoder(tok, prompt_field="p")
    with pytest.raises(ValueError, match=r"data\.response_field"):
        RecordEncoder(tok, response_field="r")
    with pytest.raises(ValueError, match=r"two different columns"):
        RecordEncoder(tok, prompt_field="x", response_field="x")
    with pytest.raises(ValueError, match=r"data\.chat_template='chatml'"):
        RecordEncoder(tok, messages_field="m", chat_template="chatml")
    with pytest.raises(ValueError, match=r"data\.messages_field"):
        RecordEncoder(tok, messages_field="")


def test_explicit_template_string_is_used():
    tok = chat_tokenizer(None)
    enc = RecordEncoder(tok, messages_field="messages", chat_template=CHATML)
    ids, target = enc.encode_batch({"messages": [CHAT]})[0]
    assert target_runs(tok, ids, target)[:2] == [REPLY1 + "<|im_end|>", REPLY2 + "<|im_end|>"]


def test_fingerprint_describes_the_encoding():
    tok = chat_tokenizer(CHATML)
    fps = {
        RecordEncoder(tok).fingerprint(),
        RecordEncoder(tok, text_field="body").fingerprint(),
        RecordEncoder(tok, messages_field="messages").fingerprint(),
        RecordEncoder(tok, messages_field="messages", chat_template="none").fingerprint(),
        RecordEncoder(tok, messages_field="messages", chat_template=COUNTING_CHATML).fingerprint(),
        RecordEncoder(tok, prompt_field="p", response_field="r").fingerprint(),
    }
    assert len(fps) == 6
    assert len({fp[:16] for fp in fps}) == 6  # a prefix is enough to tell them apart
    assert RecordEncoder(tok, messages_field="messages").describe()["mode"] == "chat"
    assert RecordEncoder(tok, messages_field="messages").fingerprint() == RecordEncoder(
        chat_tokenizer(CHATML), messages_field="messages").fingerprint()
    other = chat_tokenizer(LLAMA3_LIKE)
    assert RecordEncoder(other, messages_field="messages").fingerprint() != RecordEncoder(
        tok, messages_field="messages").fingerprint()


def test_encoder_pickles_for_worker_processes():
    import pickle

    tok = chat_tokenizer(CHATML)
    enc = RecordEncoder(tok, messages_field="messages")
    copy = pickle.loads(pickle.dumps(enc))
    (a, ta), = enc.encode_batch({"messages": [CHAT]})
    (b, tb), = copy.encode_batch({"messages": [CHAT]})
    assert a.tolist() == b.tolist() and ta.tolist() == tb.tolist()
    assert copy.fingerprint() == enc.fingerprint()
