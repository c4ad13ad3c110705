"""Chat templates and tokenizers for the record-encoding tests (offline, built from the
session's tiny tokenizer)."""

from __future__ import annotations

from tests.helpers import tiny_tokenizer

# ChatML, as Qwen / many instruction-tuned models write it.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama-3-like: trims the content, end-of-turn marker right after it, BOS text at the start.
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Mistral-like: no generation prompt, the reply is closed by the EOS token itself.
MISTRAL_LIKE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
    "[/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
# Not prefix-consistent (the header grows with the number of messages), but writes the
# contents verbatim.
COUNTING_CHATML = "{% for m in messages %}#{% endfor %} messages\n" + CHATML
# Rewrites the contents: the reply cannot be found in the rendering.
SHOUTING = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MARKERS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def chat_tokenizer(template: str | None = CHATML, *, special_markers: bool = True):
    """The tiny tokenizer with ``template`` as its chat template.

    ``special_markers``: add the template markers as special tokens (one id each, like real
    chat models); otherwise they are plain text split by BPE.
    """
    tok = tiny_tokenizer()
    if special_markers:
        tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = template
    return tok


def target_runs(tokenizer, ids, target) -> list[str]:
    """The decoded text of each maximal run of consecutive target tokens."""
    runs, cur = [], []
    for i, t in zip(ids.tolist(), target.tolist(), strict=True):
        if t:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]
