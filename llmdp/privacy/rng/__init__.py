"""The randomness behind DP-SGD: the ChaCha20 keystream (RFC 8439) and the keys it is
read under (DESIGN, invariant `secrets-stay-secret`).

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

from llmdp.privacy import entry_point

# Each name code outside this sub-package uses, by the module of it that defines it.
_NAMES = {
    "chacha": ("BLOCK_BYTES", "MAX_BLOCKS", "chacha20_keystream", "chacha20_keystream_torch",
               "check_key", "derive_key", "keystream_into", "stream_nonce", "words64"),
    "keys": ("_check_key", "_check_sample_key", "secure_key", "seeded_key"),
    "_triton_chacha": ("gauss_add_",),
}
__all__, __getattr__, __dir__, _HOMES = entry_point(__name__, _NAMES)
