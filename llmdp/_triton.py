"""Triton, optional: the CUDA kernels' import, shared by ``privacy/_triton_chacha.py`` and
``clipping/_triton_rowscaled.py``. ``triton``/``tl`` are None when it does not import (any
failure means: use the torch path). With ``TRITON_INTERPRET=1`` set before the import, the
kernels run on CPU tensors through Triton's interpreter (the tests use this)."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001
    triton = tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def available() -> bool:
    """Triton is importable (and we are on CUDA, or in Triton's interpreter)."""
    return triton is not None and (torch.cuda.is_available() or interpreting())
