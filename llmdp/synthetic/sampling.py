"""Sampling records from the model: each record's randomness is its own.

Record ``i`` draws every random number it uses (its synthetic user id, then one uniform per
generated token) from a ``torch.Generator`` seeded with ``record_seed(seed, i)`` (SHA-256
of the seed and the index), and its prompt or label is ``prompts[i mod len(prompts)]``: so
record ``i`` is the same whatever batch it is sampled in, whichever worker samples it
(local or Ray Data) and whether the run was resumed. Rows of a batch are independent in the
forward pass (left padding, masked, position ids per row) and a finished row only waits for
the others; the batch size changes nothing but speed. (Floating-point sums may differ in
their last bits between batch shapes; a token flips only if its uniform falls within that
rounding of a boundary of the cumulative distribution.)

The token draw (`draw`): logits / temperature, softmax in float64, nucleus (top-p) cut over
the probabilities sorted stably, then the inverse CDF at the record's uniform. A KV cache
(``past_key_values``) keeps each step to one new position per row.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch

from llmdp.synthetic.source import GenerateError, Schema

SAMPLER_VERSION = 1  # bump when the same (seed, index) would give another record


@dataclass(frozen=True)
class Settings:
    """Everything that decides the records (not the batch size, the workers or the path)."""

    num_records: int
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    prompts: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    num_users: int | None = None  # schema with a user field: ids drawn among this many

    def to_dict(self) -> dict:
        return {**asdict(self), "prompts": list(self.prompts), "labels": list(self.labels),
                "sampler_version": SAMPLER_VERSION}


def record_seed(seed: int, index: int) -> int:
    """The seed of record ``index``'s generator: 63 bits of SHA-256(seed, index)."""
    h = hashlib.sha256(f"llmdp-synthetic/v{SAMPLER_VERSION}/{int(seed)}/{int(index)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def conditioning(settings: Settings, index: int) -> tuple[str, str | None]:
    """(prompt text, label) of record ``index``: public inputs, cycled in order."""
    if settings.labels:
        label = settings.labels[index % len(settings.labels)]
        return label, label
    if settings.prompts:
        return settings.prompts[index % len(settings.prompts)], None
    return "", None


def prefix_ids(tokenizer, schema: Schema, prompt: str) -> list[int]:
    """The tokens sampling continues from. Text records were trained as ``text + EOS``, packed
    one after another, so a new record follows an EOS; chat and instruction records are the
    user turn rendered as training rendered it (the chat template with the generation
    prompt, or the plain ``User: ...\\nAssistant: `` format)."""
    eos = tokenizer.eos_token_id
    if schema.mode == "text":
        return [eos] + (tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else [])
    msgs = [{"role": "user", "content": prompt}]
    own = getattr(tokenizer, "chat_template", None)
    if schema.chat_template != "none" and own:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    else:
        text = f"User: {prompt}\nAssistant: "
    return [eos] + tokenizer(text, add_special_tokens=False)["input_ids"]


def draw(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] at the row's uniform in [0, 1)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(p, dim=-1)
    if top_p < 1.0:
        keep = (cum - p) < top_p  # the smallest prefix whose mass reaches top_p (>= 1 token)
        p = torch.where(keep, p, torch.zeros_like(p))
        cum = torch.cumsum(p, dim=-1)
    target = uniforms.double().unsqueeze(1) * cum[:, -1:]
    pos = torch.searchsorted(cum, target, right=True).clamp(max=p.shape[1] - 1)
    # never a token of zero mass (a uniform at the very top of the kept mass)
    pos = torch.minimum(pos, (p > 0).sum(dim=1, keepdim=True) - 1)
    return order.gather(1, pos).squeeze(1)


@torch.no_grad()
def sample_tokens(model, prefixes: list[list[int]], gens: list[torch.Generator], *,
                  max_new_tokens: int, temperature: float, top_p: float, eos_id: int,
                  pad_id: int) -> list[list[int]]:
    """The generated tokens of each row (EOS excluded), rows independent of each other."""
    b, width = len(prefixes), max(len(p) for p in prefixes)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for r, p in enumerate(prefixes):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    past, logits = _forward(model, ids, mask, pos, None)
    done = [False] * b
    generated: list[list[int]] = [[] for _ in range(b)]
    last_pos = pos[:, -1:]
    for step in range(max_new_tokens):
        # one uniform per live row, from that row's own generator
        u = torch.tensor([torch.rand((), generator=g, dtype=torch.float64).item() if not d else 0.0
                          for g, d in zip(gens, done)], dtype=torch.float64)
        tok = draw(logits, u, temperature, top_p).tolist()
        for r in range(b):
            if done[r]:
                tok[r] = pad_id
            elif tok[r] == eos_id:
                done[r], tok[r] = True, pad_id
            else:
                generated[r].append(int(tok[r]))
        if all(done) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
        last_pos = last_pos + 1
        past, logits = _forward(model, torch.tensor(tok, dtype=torch.long).unsqueeze(1), mask,
                                last_pos, past)
    return generated


def _forward(model, ids, mask, pos, cache):
    """(the KV cache, the last position's logits): transformers 5 names the cache ``cache``,
    earlier versions ``past_key_values``."""
    import inspect

    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                **({name: cache} if cache is not None else {}), **kw)
    new = getattr(out, "cache", None)
    if new is None:
        new = out.past_key_values
    return new, out.logits[:, -1, :]


def max_positions(model) -> int | None:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def check_lengths(model, tokenizer, schema: Schema, settings: Settings) -> None:
    """Refuse a prompt + --max-new-tokens longer than the model's positions (before sampling)."""
    limit = max_positions(model)
    if limit is None:
        return
    texts = [conditioning(settings, i)[0] for i in range(max(1, len(settings.labels or settings.prompts)))]
    longest = max(len(prefix_ids(tokenizer, schema, t)) for t in texts)
    if longest + settings.max_new_tokens > limit:
        raise GenerateError(
            f"--max-new-tokens {settings.max_new_tokens}: with the longest prompt ({longest} "
            f"tokens) it exceeds the model's {limit} positions (max_position_embeddings); use "
            f"--max-new-tokens {max(1, limit - longest)} or shorter prompts")


def records_for(model, tokenizer, schema: Schema, settings: Settings, indices: list[int]) -> list[dict]:
    """The records of ``indices``, in order (one forward batch)."""
    prefixes, gens, users, conds = [], [], [], []
    for i in indices:
        g = torch.Generator().manual_seed(record_seed(settings.seed, i))
        prompt, label = conditioning(settings, i)
        user = None
        if schema.user_field:
            n = settings.num_users or 1
            user = f"synthetic-user-{int(torch.randint(n, (1,), generator=g).item())}"
        prefixes.append(prefix_ids(tokenizer, schema, prompt))
        gens.append(g)
        users.append(user)
        conds.append((prompt, label))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    toks = sample_tokens(model, prefixes, gens, max_new_tokens=settings.max_new_tokens,
                         temperature=settings.temperature, top_p=settings.top_p,
                         eos_id=tokenizer.eos_token_id, pad_id=pad)
    out = []
    for prefix, gen, user, (prompt, label) in zip(prefixes, toks, users, conds):
        if schema.mode == "text":
            rec = {schema.text_field: tokenizer.decode(prefix[1:] + gen, skip_special_tokens=True)}
        else:
            reply = tokenizer.decode(gen, skip_special_tokens=True)
            if schema.chat_template == "none" or not getattr(tokenizer, "chat_template", None):
                reply = reply.split("\n", 1)[0]  # the plain format's end of turn
            if schema.mode == "chat":
                rec = {schema.messages_field: [{"role": "user", "content": prompt},
                                               {"role": "assistant", "content": reply}]}
            else:
                rec = {schema.prompt_field: prompt, schema.response_field: reply}
        if user is not None:
            rec[schema.user_field] = user
        if label is not None:
            rec["label"] = label
        out.append(rec)
    return out
