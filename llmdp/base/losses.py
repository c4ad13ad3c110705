"""Per-unit normalized loss (DESIGN, invariant `unit-is-a-unit`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

#: Positions (row x token) per chunk of the cross-entropy: the float32 logits of one
#: chunk, 2**22 x V, are the most that exists at once (None: no chunking).
CE_CHUNK_ELEMENTS = 1 << 26


def row_losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's share of its unit's normalized loss (DESIGN, invariant `unit-is-a-unit`).

    A unit's loss is the mean cross-entropy over *all* its target tokens; a row's entry is
    the sum over its own target tokens divided by the unit's target-token count, so that
    the unit's loss is the sum of its rows' entries. Padding tokens (label -100) add 0.
    """
    _, ce, _ = _forward(model, batch)
    denom = batch["num_target_tokens"].to(ce.dtype).clamp(min=1)
    return ce.sum(dim=1) / denom


def row_eval_stats(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per row [R, 4], in float64: the row's share of its unit's normalized loss (as
    :func:`row_losses`), its share of the unit's token accuracy (correct next-token
    predictions, argmax, over the unit's target tokens), the sum of its tokens'
    cross-entropy and its own number of target tokens. Summed over a unit's rows: the
    unit's loss and accuracy; over all rows: the token-level NLL and count (perplexity)."""
    logits, ce, labels = _forward(model, batch)
    target = labels != -100
    correct = (logits.argmax(dim=-1) == labels) & target
    denom = batch["num_target_tokens"].to(torch.float64).clamp(min=1)
    ce_sum = ce.to(torch.float64).sum(dim=1)
    return torch.stack([ce_sum / denom, correct.sum(dim=1).to(torch.float64) / denom, ce_sum,
                        target.sum(dim=1).to(torch.float64)], dim=1)


def _forward(model: nn.Module, batch: dict[str, torch.Tensor]):
    """(shifted logits, per-token cross-entropy [R, T-1], shifted labels)."""
    attention_mask = batch["attention_mask"]
    # A row whose every position is masked (a padding row) would make attention softmax
    # over nothing; let it attend to its own pad tokens instead. Its labels are all -100
    # and its unit id -1, so it contributes exactly zero either way.
    empty = attention_mask.sum(dim=1, keepdim=True) == 0
    attention_mask = torch.where(empty, torch.ones_like(attention_mask), attention_mask)
    kwargs = {}
    if "segment_ids" in batch:  # document masking: no attention across documents in a row
        # float32 (float64 for a float64 model) whatever the compute dtype: SDPA accepts a
        # float mask with any query dtype, eager attention adds it with type promotion, and
        # under autocast the query's dtype is not knowable here.
        weight_dtype = model.get_input_embeddings().weight.dtype
        dtype = torch.float64 if weight_dtype == torch.float64 else torch.float32
        attention_mask, kwargs["position_ids"] = segment_attention(batch["segment_ids"], dtype)
    out = model(input_ids=batch["input_ids"], attention_mask=attention_mask, use_cache=False, **kwargs)
    logits = out.logits[:, :-1, :]
    labels = batch["labels"][:, 1:]
    return logits, token_cross_entropy(logits, labels), labels


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # the loss in at least float32
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")


def _in_functorch() -> bool:
    """Inside a torch.func transform (the reference's per-row grad), which does not support
    the saved-tensor hooks of checkpointing: the loss is computed unchunked there."""
    try:
        return torch._C._functorch.peek_interpreter_stack() is not None
    except AttributeError:  # an older torch: no such transform in use here
        return False


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                        chunk_elements: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy [R, T] in at least float32 (0 where the label is -100).

    Chunked over positions when the logits are large: each chunk is upcast and
    log-softmaxed on its own under activation checkpointing (recomputed in the backward),
    so neither a float32 copy of the [R, T, V] logits nor the log-softmax saved for the
    backward ever exists whole, only one chunk of ``chunk_elements`` at a time. The values
    are those of the unchunked loss, bit for bit (the same per-position operations)."""
    R, T, V = logits.shape
    limit = CE_CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    flat_logits, flat_labels = logits.reshape(R * T, V), labels.reshape(R * T)
    if not limit or R * T * V <= limit or not torch.is_grad_enabled() or _in_functorch():
        return _ce(flat_logits, flat_labels).view(R, T)
    step = max(1, limit // V)
    parts = [checkpoint(_ce, flat_logits[s : s + step], flat_labels[s : s + step], use_reentrant=False)
             for s in range(0, R * T, step)]
    return torch.cat(parts).view(R, T)


def segment_attention(segment_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-diagonal causal attention for rows packing several documents.

    Returns an additive 4-D mask [R, 1, T, T] (0 where token i may attend to token j: j <= i
    and same segment; the dtype's most negative value elsewhere) and position ids that
    restart at 0 with every segment. Padding (segment -1) attends only to padding, so no
    row is left attending to nothing.
    """
    R, T = segment_ids.shape
    device = segment_ids.device
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    allowed = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])
    zero = torch.zeros((), dtype=dtype, device=device)
    mask = torch.where(allowed[:, None], zero, torch.finfo(dtype).min)  # out of place: vmap-safe
    idx = torch.arange(T, device=device).expand(R, T)
    change = torch.ones_like(segment_ids, dtype=torch.bool)
    change[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start = torch.where(change, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return mask, idx - start
