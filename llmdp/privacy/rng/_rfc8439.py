"""RFC 8439 §2.3: the ChaCha20 state's first four words, "expand 32-byte k" little-endian.
One definition for the CPU/torch implementation (``chacha.py``) and the Triton kernels
(``_triton_chacha.py``), which both build the same initial state from it."""

CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)
