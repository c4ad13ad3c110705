"""The randomness behind DP-SGD: the ChaCha20 keystream (RFC 8439) and the keys it is
read under (DESIGN §3.7).

- `chacha`: the keystream (OpenSSL on CPU, the Triton kernel on CUDA, a torch-ops
  reference), its stream nonces and key derivation;
- `keys`: step keys (`secure_key`: OS entropy; `seeded_key`: a seed, for tests and
  reproducible releases) and their checks;
- `_triton_chacha`: the CUDA kernels, the keystream and the fused keystream + Box-Muller +
  in-place add that `noise` calls (imported only when asked, on CUDA);
- `_rfc8439`: the state constants both implementations share.

Names are looked up in their modules on first use: importing this package loads nothing.
"""

from __future__ import annotations

# Each name code outside this sub-package uses, by the module of it that defines it.
_NAMES = {
    "chacha": ("BLOCK_BYTES", "MAX_BLOCKS", "chacha20_keystream", "chacha20_keystream_torch",
               "check_key", "derive_key", "keystream_into", "stream_nonce", "words64"),
    "keys": ("_check_key", "_check_sample_key", "secure_key", "seeded_key"),
    "_triton_chacha": ("gauss_add_",),
}
_HOMES = {name: module for module, names in _NAMES.items() for name in names}

__all__ = sorted(name for name in _HOMES if not name.startswith("_"))


def __getattr__(name: str):
    # Looked up in the defining module at every access, never cached here: a test that
    # patches that module's attribute is seen by every caller that reaches it through here.
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
