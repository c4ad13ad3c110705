"""Shims over the transformers versions llmdp supports (4.x and 5.x) and the Hugging Face Hub's
offline and connection signals, shared by the data loader (``data/sources.py``), the tokenizer
adaptation (``tokenizer/adapt.py``), the model loader (``train/models.py``, which also checks
a Hub model id: `llmdp.train.models.check_hub_model`) and the export (``hub/folder.py``)."""

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


def quiet_peft():
    """A context in which peft's use of transformers 5.x's deprecated
    ``is_gradient_checkpointing`` does not warn (a FutureWarning on every LoRA model built
    or loaded; nothing for the user to act on)."""
    import contextlib
    import warnings

    @contextlib.contextmanager
    def ctx():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            yield

    return ctx()


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the Hub could not be reached (offline mode, DNS, refused, timeout),
    whichever HTTP client ``huggingface_hub`` uses (httpx, or httpx2 in later versions)."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    if isinstance(exc, (ConnectionError, OfflineModeIsEnabled, LocalEntryNotFoundError, TimeoutError)):
        return True
    return any(c.__module__.split(".")[0].startswith("httpx") and c.__name__ in
               ("TransportError", "TimeoutException", "NetworkError") for c in type(exc).__mro__)


def hub_offline_flag() -> bool:
    import huggingface_hub.constants as hub_constants

    return bool(hub_constants.HF_HUB_OFFLINE)
