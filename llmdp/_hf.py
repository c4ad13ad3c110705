"""Shims over the transformers versions llmdp supports (4.x and 5.x), shared by the model
loader (``models.py``) and the tokenizer adaptation (``tokenizer/adapt.py``)."""

from __future__ import annotations

import inspect


def save_kwargs(model) -> dict:
    """safetensors on transformers 4.x too (5.x always writes them)."""
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        return {"safe_serialization": True}
    return {}


def dtype_kwarg() -> str:
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return "dtype" if major >= 5 else "torch_dtype"
