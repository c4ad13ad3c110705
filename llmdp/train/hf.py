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


def check_hub_model(name: str, key: str) -> None:
    """A ``model.name_or_path`` / ``model.tokenizer`` that is not a local folder is a Hub id:
    it must be in the local Hugging Face cache or reachable, else one message says how to
    bring it to an air-gapped machine (transformers would retry the network for about a
    minute and end in an OSError traceback). Raises ``ConfigError``."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    from llmdp.config.validate import ConfigError

    try:
        for fname in ("config.json", "tokenizer_config.json", "tokenizer.json"):
            if isinstance(try_to_load_from_cache(name, fname), str):
                return  # cached: transformers loads it (offline too)
    except HFValidationError as e:
        raise ConfigError(f"{key}: {name!r} is neither a local folder nor a Hub id like org/name "
                          f"({e}); fix the path or the id", key=key) from None
    fix = (f"on a machine with network run `hf download {name} --local-dir DIR`, copy DIR "
           f"here and set {key}=DIR (a local folder), or copy that machine's Hugging Face cache "
           f"(HF_HOME)")
    if hub_offline_flag():
        raise ConfigError(f"{key}: {name!r} is not a local folder and not in the Hugging Face "
                          f"cache, and offline mode is on (HF_HUB_OFFLINE): {fix}", key=key)
    try:
        HfApi().model_info(name, timeout=10)
    except (RepositoryNotFoundError, GatedRepoError) as e:
        gated = isinstance(e, GatedRepoError)
        raise ConfigError(f"{key}: {name!r} is not a local folder, and the Hub "
                          + ("holds it as a gated model: accept its terms and `hf auth login`"
                             if gated else "has no such model (check the id; a private model "
                             "needs `hf auth login`)"), key=key) from None
    except Exception as e:  # noqa: BLE001 - sorted below
        if not is_connection_error(e):
            raise
        raise ConfigError(f"{key}: {name!r} is not a local folder and not in the Hugging Face "
                          f"cache, and the Hub cannot be reached ({type(e).__name__}: {e}): "
                          f"{fix}", key=key) from None
