"""ChaCha20 (RFC 8439): every implementation against the RFC's vectors, against each other
bit for bit (OpenSSL on CPU, plain torch ops, Triton on CUDA and in Triton's interpreter),
seeking, and the key derivation."""

import os
import textwrap

import numpy as np
import pytest
import torch

from llmdp.privacy.rng import chacha
from tests.helpers import run_interpreted

# --------------------------------------------------------------------------- RFC 8439 vectors

KEY_SEQ = bytes(range(32))
# §2.3.2: the block function, key 00..1f, nonce 000000090000004a00000000, counter 1 (words).
BLOCK_232 = [
    0xE4E7F110, 0x15593BD1, 0x1FDD0F50, 0xC47120A3, 0xC7F4D1C7, 0x0368C033, 0x9AAA2204, 0x4E6CD4C3,
    0x466482D2, 0x09AA9F07, 0x05D7C214, 0xA2028BD9, 0xD19C12B5, 0xB94E16DE, 0xE883D0CB, 0x4E3C50A2,
]
# §2.4.2: encryption, key 00..1f, nonce 000000000000004a00000000, counter 1.
PT_242 = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for "
          b"the future, sunscreen would be it.")
CT_242 = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0bf91b65c5524733ab8f593dabcd62"
    "b3571639d624e65152ab8f530c359f0861d807ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91a"
    "b77937365af90bbf74a35be6b40b8eedf2785e42874d"
)
# A.1: the block function (key, nonce, counter) -> 64 bytes of keystream.
A1 = [
    ("00" * 32, "00" * 12, 0, "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7da41597c"
     "5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"),
    ("00" * 32, "00" * 12, 1, "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed29b72176"
     "9ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f"),
    ("00" * 31 + "01", "00" * 12, 1, "3aeb5224ecf849929b9d828db1ced4dd832025e8018b8160b82284f3c949aa5a8e"
     "ca00bbb4a73bdad192b5c42f73f2fd4e273644c8b36125a64addeb006c13a0"),
    ("00ff" + "00" * 30, "00" * 12, 2, "72d54dfbf12ec44b362692df94137f328fea8da73990265ec1bbbea1ae9af0ca"
     "13b25aa26cb4a648cb9b9d1be65b2c0924a66c54d545ec1b7374f4872e99f096"),
    ("00" * 32, "00" * 11 + "02", 0, "c2c64d378cd536374ae204b9ef933fcd1a8b2288b3dfa49672ab765b54ee27c78a"
     "970e0e955c14f3a88e741b97c286f75f8fc299e8148362fa198a39531bed6d"),
]
# A.2: encryption (key, nonce, counter, plaintext, ciphertext).
_IETF = (
    b"Any submission to the IETF intended by the Contributor for publication as all or part of an IETF "
    b"Internet-Draft or RFC and any statement made within the context of an IETF activity is considered "
    b"an \"IETF Contribution\". Such statements include oral statements in IETF sessions, as well as "
    b"written and electronic communications made at any time or place, which are addressed to"
)
_JABBER = (b"'Twas brillig, and the slithy toves\nDid gyre and gimble in the wabe:\n"
           b"All mimsy were the borogoves,\nAnd the mome raths outgrabe.")
A2 = [
    ("00" * 32, "00" * 12, 0, bytes(64), bytes.fromhex(A1[0][3])),
    ("00" * 31 + "01", "00" * 11 + "02", 1, _IETF, bytes.fromhex(
        "a3fbf07df3fa2fde4f376ca23e82737041605d9f4f4f57bd8cff2c1d4b7955ec2a97948bd3722915c8f3d337f7d3"
        "70050e9e96d647b7c39f56e031ca5eb6250d4042e02785ececfa4b4bb5e8ead0440e20b6e8db09d881a7c6132f42"
        "0e52795042bdfa7773d8a9051447b3291ce1411c680465552aa6c405b7764d5e87bea85ad00f8449ed8f72d0d662"
        "ab052691ca66424bc86d2df80ea41f43abf937d3259dc4b2d0dfb48a6c9139ddd7f76966e928e635553ba76c5c87"
        "9d7b35d49eb2e62b0871cdac638939e25e8a1e0ef9d5280fa8ca328b351c3c765989cbcf3daa8b6ccc3aaf9f3979"
        "c92b3720fc88dc95ed84a1be059c6499b9fda236e7e818b04b0bc39c1e876b193bfe5569753f88128cc08aaa9b63"
        "d1a16f80ef2554d7189c411f5869ca52c5b83fa36ff216b9c1d30062bebcfd2dc5bce0911934fda79a86f6e698ce"
        "d759c3ff9b6477338f3da4f9cd8514ea9982ccafb341b2384dd902f3d1ab7ac61dd29c6f21ba5b862f3730e37cfd"
        "c4fd806c22f221")),
    ("1c9240a5eb55d38af333888604f6b5f0473917c1402b80099dca5cbc207075c0", "00" * 11 + "02", 42, _JABBER,
     bytes.fromhex(
         "62e6347f95ed87a45ffae7426f27a1df5fb69110044c0d73118effa95b01e5cf166d3df2d721caf9b21e5fb14c61"
         "6871fd84c54f9d65b283196c7fe4f60553ebf39c6402c42234e32a356b3e764312a61a5532055716ead6962568f8"
         "7d3f3f7704c6a8d1bcd1bf4d50d6154b6da731b187b58dfd728afa36757a797ac188d1")),
]


def _words_to_bytes(w: torch.Tensor) -> bytes:
    w = w.cpu()
    assert w.dtype in (torch.int64, torch.int32)
    if w.dtype == torch.int64:
        assert int(w.min()) >= 0 and int(w.max()) < 2**32  # the unsigned values
    return np.asarray(w.numpy(), dtype=np.int64).astype("<u4").tobytes()


def _keystream_bytes(impl, key: bytes, nonce: bytes, counter: int, n: int, device="cpu") -> bytes:
    return _words_to_bytes(impl(key, nonce, counter, -(-n // 4), device=device))[:n]


IMPLS = {"openssl": chacha.chacha20_keystream, "torch": chacha.chacha20_keystream_torch}


@pytest.mark.parametrize("impl", IMPLS)
def test_rfc8439_block_function_232(impl):
    w = IMPLS[impl](KEY_SEQ, bytes.fromhex("000000090000004a00000000"), 1, 16)
    assert w.tolist() == BLOCK_232


@pytest.mark.parametrize("impl", IMPLS)
def test_rfc8439_encryption_242(impl):
    ks = _keystream_bytes(IMPLS[impl], KEY_SEQ, bytes.fromhex("000000000000004a00000000"), 1, len(PT_242))
    assert bytes(a ^ b for a, b in zip(PT_242, ks)) == CT_242


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(A1)))
def test_rfc8439_appendix_a1_block_vectors(impl, case):
    key, nonce, counter, want = A1[case]
    assert _keystream_bytes(IMPLS[impl], bytes.fromhex(key), bytes.fromhex(nonce), counter, 64) == \
        bytes.fromhex(want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(A2)))
def test_rfc8439_appendix_a2_encryption_vectors(impl, case):
    key, nonce, counter, pt, ct = A2[case]
    ks = _keystream_bytes(IMPLS[impl], bytes.fromhex(key), bytes.fromhex(nonce), counter, len(pt))
    assert bytes(a ^ b for a, b in zip(pt, ks)) == ct


# --------------------------------------------------------------------------- seeking, agreement

CASES = [(0, 1), (0, 16), (1, 15), (3, 17), (7, 1000), (123_456, 333), (2**32 - 3, 47)]


@pytest.mark.parametrize("counter,n_words", CASES)
def test_openssl_and_torch_agree_bit_for_bit(counter, n_words):
    key, nonce = os.urandom(32), os.urandom(12)
    a = chacha.chacha20_keystream(key, nonce, counter, n_words)
    b = chacha.chacha20_keystream_torch(key, nonce, counter, n_words)
    assert a.dtype == torch.int64 and a.shape == (n_words,)
    assert torch.equal(a, b)


def test_seekable_any_cut_gives_the_same_words():
    key, nonce = os.urandom(32), os.urandom(12)
    whole = chacha.chacha20_keystream(key, nonce, 5, 16 * 40)
    for counter in (5, 6, 17, 44):
        for n in (1, 3, 16, 17, 100):
            lo = 16 * (counter - 5)
            if lo + n <= whole.numel():
                assert torch.equal(chacha.chacha20_keystream(key, nonce, counter, n), whole[lo : lo + n])
    # words64: 64-bit word j = stream words 2j (low) and 2j + 1 (high), from any offset.
    w = whole.numpy().astype(np.uint64)
    as64 = w[0::2] | (w[1::2] << np.uint64(32))
    for first in (0, 1, 7, 8, 9, 100, 255):
        for n in (1, 5, 8, 33):
            got = chacha.words64(key, nonce, 5 * 8 + first, n)
            assert np.array_equal(got, as64[first : first + n])


def test_counter_overrun_and_bad_inputs_are_refused():
    key, nonce = b"k" * 32, b"n" * 12
    assert chacha.chacha20_keystream(key, nonce, 2**32 - 1, 16).numel() == 16  # the last block
    with pytest.raises(ValueError, match="32-bit block counter"):
        chacha.chacha20_keystream(key, nonce, 2**32 - 1, 17)
    with pytest.raises(ValueError, match="32-bit block counter"):
        chacha.chacha20_keystream_torch(key, nonce, 2**32 - 2, 33)
    with pytest.raises(ValueError, match="counter must be an integer"):
        chacha.chacha20_keystream(key, nonce, 2**32, 1)
    with pytest.raises(ValueError, match="key is 32 bytes"):
        chacha.chacha20_keystream(b"k" * 16, nonce, 0, 1)
    with pytest.raises(ValueError, match="nonce is 12 bytes"):
        chacha.chacha20_keystream(key, b"n" * 8, 0, 1)
    with pytest.raises(ValueError, match="n_words"):
        chacha.chacha20_keystream(key, nonce, 0, -1)
    assert chacha.chacha20_keystream(key, nonce, 0, 0).numel() == 0


def test_derived_keys_are_block_zero_of_their_label_and_independent():
    step = os.urandom(32)
    noise, sample = chacha.derive_key(step, b"noise"), chacha.derive_key(step, b"sample")
    assert len(noise) == len(sample) == 32 and noise != sample and step not in (noise, sample)
    want = _words_to_bytes(chacha.chacha20_keystream(step, b"kdf:noise\0\0\0", 0, 8))
    assert noise == want
    assert chacha.derive_key(step, b"noise") == noise  # deterministic
    assert chacha.derive_key(os.urandom(32), b"noise") != noise
    with pytest.raises(ValueError, match="label"):
        chacha.derive_key(step, b"a-label-too-long")
    # Stream nonces can never be a key-derivation nonce.
    with pytest.raises(ValueError, match="tag"):
        chacha.stream_nonce(b"kdf:", 0)
    assert chacha.stream_nonce(b"gaus", 1) == b"gaus" + (1).to_bytes(8, "little")


# --------------------------------------------------------------------------- CUDA


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("counter,n_words", CASES + [(0, 1 << 22), (99, (1 << 20) + 5)])
def test_cuda_keystream_is_bit_identical_to_cpu(counter, n_words):
    dev = _cuda()
    key, nonce = os.urandom(32), os.urandom(12)
    cpu = chacha.chacha20_keystream(key, nonce, counter, n_words)
    cuda = chacha.chacha20_keystream(key, nonce, counter, n_words, device=dev)
    assert cuda.device.type == "cuda"
    assert torch.equal(cuda.cpu(), cpu)
    assert torch.equal(chacha.chacha20_keystream_torch(key, nonce, counter, n_words, device=dev).cpu(), cpu)


@pytest.mark.gpu
def test_cuda_rfc_vectors():
    dev = _cuda()
    w = chacha.chacha20_keystream(KEY_SEQ, bytes.fromhex("000000090000004a00000000"), 1, 16, device=dev)
    assert w.cpu().tolist() == BLOCK_232
    for key, nonce, counter, pt, ct in A2:
        ks = _keystream_bytes(chacha.chacha20_keystream, bytes.fromhex(key), bytes.fromhex(nonce),
                              counter, len(pt), device=dev)
        assert bytes(a ^ b for a, b in zip(pt, ks)) == ct


# --------------------------------------------------------------------------- Triton, interpreted

_INTERPRETED = textwrap.dedent(
    """
    import os, sys, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from llmdp.privacy.rng import _triton_chacha as T
    from llmdp.privacy.rng import chacha
    from llmdp.privacy.noise import gaussian as noise
    assert T.available()
    w = T.keystream(bytes(range(32)), bytes.fromhex("000000090000004a00000000"), 1, 16, "cpu")
    assert w.tolist() == {block}, w.tolist()
    for counter, n in [(0, 1), (3, 17), (2**32 - 40, 600), (12345, 16 * 300 + 5)]:
        key, nonce = os.urandom(32), os.urandom(12)
        assert torch.equal(T.keystream(key, nonce, counter, n, "cpu"),
                           chacha.chacha20_keystream(key, nonce, counter, n)), (counter, n)
    # The fused noise kernel: the same draws as the CPU path (float64 transcendental
    # functions may differ by an ulp: numpy's in the interpreter), any offset and length.
    key = os.urandom(32)
    whole = noise.gaussian_like((5000,), key, 7, 1.3, dtype=torch.float64)
    for first, n in [(0, 5000), (1, 9), (8, 8), (13, 2000), (4999, 1)]:
        t = torch.full((n,), 0.25, dtype=torch.float64)
        T.gauss_add_(t, key, noise._nonce(7), first, 1.3)
        ref = whole[first : first + n] + 0.25
        err = float(((t - ref).abs() / ref.abs().clamp(min=1.0)).max())
        assert err < 1e-13, (first, n, err)
    t32 = torch.zeros(3000)
    T.gauss_add_(t32, key, noise._nonce(7), 100, 1.3)
    ref32 = whole[100:3100].float()
    assert float((t32 - ref32).abs().max()) <= 2.0**-20, float((t32 - ref32).abs().max())
    # The kernel's transform on chosen words (its ChaCha20 words cannot be chosen): k1 = 0,
    # where u1 = (k2 + 1)·2**-106 alone sets the radius, small k1, and random words, with
    # the ignored bits set; the largest draw at all-zero words.
    import random
    rng = random.Random(5)
    m53 = (1 << 53) - 1
    def signed(w):
        return w - (1 << 64) if w >= 1 << 63 else w
    rows = [[0, 0, 0, 0], [0x7FF << 53, 0x7FF << 53, 0x7FF, (1 << 64) - 1]]
    for i in range(3000):
        w = [rng.getrandbits(64) for _ in range(4)]
        if i % 3 == 0:
            w[0] &= ~m53  # k1 = 0
        elif i % 3 == 1:
            w[0] &= ~m53 | ((1 << rng.randrange(1, 20)) - 1)  # small k1
        rows.append(w)
    words = torch.tensor([[signed(w) for w in r] for r in rows], dtype=torch.int64)
    got = T.pairs_from_words(words, 1.3)
    want = noise._pairs(words, 1.3, {"dtype": torch.float64})
    err = float(((got - want).abs() / want.abs().clamp(min=1.0)).max())
    assert err < 1e-13, err
    assert abs(float(got[0, 0]) / (1.3 * noise.NOISE_TAIL) - 1) < 1e-15 and float(got[1, 0]) == float(got[0, 0])
    assert float(got.norm(dim=1)[2::3].min()) > 1.3 * 8.57  # k1 = 0: past the 53-bit cap
    print("ok")
    """
)


def test_triton_kernels_in_the_interpreter_match_the_cpu_path():
    """The CUDA kernels' logic (uint32 lanes, masks, seeking, the fused transform), run by
    Triton's interpreter on CPU: bit-identical keystream, the same noise to float64 ulps."""
    pytest.importorskip("triton", reason="the test extra installs triton")
    res = run_interpreted(_INTERPRETED.replace("{block}", repr(BLOCK_232)))
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
