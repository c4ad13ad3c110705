"""Per-unit normalized loss (DESIGN §3.4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def row_losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's share of its unit's normalized loss (DESIGN §3.4).

    A unit's loss is the mean cross-entropy over *all* its target tokens; a row's entry is
    the sum over its own target tokens divided by the unit's target-token count, so that
    the unit's loss is the sum of its rows' entries. Padding tokens (label -100) add 0.
    """
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
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # the loss in at least float32
    ce = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    denom = batch["num_target_tokens"].to(ce.dtype).clamp(min=1)
    return ce.sum(dim=1) / denom


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
