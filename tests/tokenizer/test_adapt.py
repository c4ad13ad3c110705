"""Adapting a pretrained model to a new tokenizer: token texts, embedding re-initialization
(checked against a reference written here), tied / untied output embeddings, the cached
adapted folder of ``load_model``, and the config rule."""

import copy
import pathlib
import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode as hf_bytes_to_unicode

from llmdp.config.schema import ConfigError, LoraConfig, ModelConfig, recipe_from_dict
from llmdp.tokenizer.adapt import (
    ADAPTED_MARKER,
    adapt_embeddings,
    build_adapted_model,
    token_texts,
    tokenizer_style,
    vocab_adaptation_stats,
)
from llmdp.tokenizer.private import train_sentencepiece_from_counts
from llmdp.train.models import build_tiny_model, load_model
from tests.helpers import tiny_model, tiny_model_config

REPO = pathlib.Path(__file__).resolve().parents[2]
BASE_DIR = str(REPO / "tokenizers" / "demo-public")
SP = "\u2581"
MODEL_TYPES = ["unigram", "bpe"]

WORDS = (
    "the of and to in is was with for on at by from as patient reports chest pain fever "
    "cough shortness breath hypertension diabetes mellitus metformin lisinopril atorvastatin "
    "amlodipine heart lungs liver kidney kidneys blood pressure dose daily tablet tablets "
    "morning evening history examination normal abnormal follow up clinic pharmacy doctor "
    "nurse hospital admitted discharged mg twice once weekly symptoms nausea headache "
    "dizziness fatigue swelling weight loss treatment therapy diagnosis chronic acute "
    "infection antibiotic insulin glucose cholesterol, pain. fever; (mild) 120/80 2024 "
    "café naïve résumé Zürich 日本 €5 ok! x\u00a0y"
).split(" ")


def _counts() -> dict:
    rng = random.Random(0)
    counts = {w: rng.randint(5, 300) for w in WORDS if w}
    syll = ("ka", "ro", "mi", "ten", "sul", "pra", "do", "lin", "ex", "qua", "ve", "zor")
    while len(counts) < 300:
        w = "".join(rng.choice(syll) for _ in range(rng.randint(1, 4)))
        counts.setdefault(w, rng.randint(1, 60))
    return counts


@pytest.fixture(scope="module")
def new_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("new-tokenizers")
    return {mt: train_sentencepiece_from_counts(_counts(), vocab_size=400, model_type=mt,
                                                out_dir=root / mt)
            for mt in MODEL_TYPES}


@pytest.fixture(scope="module")
def base_tok():
    return AutoTokenizer.from_pretrained(BASE_DIR)


TEXTS = [
    "Patient reports chest pain and fever.",
    "metformin 500 mg twice daily; BP 120/80",
    "  double  spaces\tand a tab\nnewline ",
    "café naïve Zürich 日本 €5 \U0001F600 ünïcödé",
    "kaqua sulro prami",
    "",
]


# ----------------------------------------------------------------------------- reference


def _piece_bytes(piece: str) -> bytes:
    """A SentencePiece piece's bytes, written independently of the module under test."""
    m = re.fullmatch(r"<0x([0-9A-F]{2})>", piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace(SP, " ").encode("utf-8")


def _reference(W: torch.Tensor, base, new) -> tuple[torch.Tensor, dict]:
    """New rows for the SentencePiece ``new`` from base matrix ``W`` (a plain loop)."""
    b2u = hf_bytes_to_unicode()
    W = W.detach().to(torch.float64)
    base_pad = base.pad_token_id if base.pad_token_id is not None else base.eos_token_id
    role = {new.bos_token_id: base.bos_token_id, new.eos_token_id: base.eos_token_id,
            new.unk_token_id: base.unk_token_id, new.pad_token_id: base_pad}
    special = set(new.all_special_ids)
    rows, kinds = [], {"copied": 0, "mean_of_pieces": 0, "special": 0, "fallback": 0}
    for i in range(len(new)):
        if i in role and role[i] is not None:
            rows.append(W[role[i]].clone())
            kinds["special"] += 1
            continue
        if i in special:
            rows.append(W.mean(0))
            kinds["fallback"] += 1
            continue
        data = _piece_bytes(new.convert_ids_to_tokens(i))  # added tokens: normalized content
        try:
            ids = base(data.decode("utf-8"), add_special_tokens=False).input_ids
        except UnicodeDecodeError:
            assert len(data) == 1
            ids = [base.convert_tokens_to_ids(b2u[data[0]])]
        assert ids and base.unk_token_id not in ids
        acc = torch.zeros(W.shape[1], dtype=torch.float64)
        for j in ids:
            acc += W[j]
        rows.append(acc / len(ids))
        kinds["copied" if len(ids) == 1 else "mean_of_pieces"] += 1
    return torch.stack(rows), kinds


# ----------------------------------------------------------------------------- token texts


def test_styles(new_dirs, base_tok):
    assert tokenizer_style(base_tok) == "byte_level"
    for d in new_dirs.values():
        assert tokenizer_style(AutoTokenizer.from_pretrained(d)) == "metaspace"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_token_texts_sentencepiece(new_dirs, model_type):
    tok = AutoTokenizer.from_pretrained(new_dirs[model_type])
    texts = token_texts(tok)
    assert len(texts) == len(tok)
    assert texts[:4] == [None] * 4  # <s> </s> <pad> <unk>
    assert all(t is not None for t in texts[4:])
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    # byte-fallback pieces are their byte; "▁" is a space
    for i, p in enumerate(pieces):
        if re.fullmatch(r"<0x[0-9A-F]{2}>", p):
            assert texts[i] == bytes([int(p[3:5], 16)]), p
    assert sum(len(t) == 1 for t in texts[4:260]) == 256
    assert {t for t in texts[4:260]} == {bytes([b]) for b in range(256)}
    # A word piece "▁word" is the text " word": encoding "word" (the dummy prefix adds the
    # space) gives the piece back, wherever the model does not prefer a split.
    word_ids = [i for i, p in enumerate(pieces) if p.startswith(SP) and len(p) > 1]
    assert len(word_ids) > 20
    back = 0
    for i in word_ids:
        t = texts[i]
        assert t.startswith(b" ") and t[1:].decode() == pieces[i][1:].replace(SP, " ")
        back += tok(t[1:].decode(), add_special_tokens=False).input_ids == [i]
    assert back >= 0.9 * len(word_ids)
    # Concatenated token texts give back the text (with the dummy-prefix space).
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.unk_token_id not in ids
        assert b"".join(texts[i] for i in ids) == (" " + text if text else "").encode(), text


def test_token_texts_byte_level(base_tok):
    texts = token_texts(base_tok)
    assert len(texts) == len(base_tok) and texts[:4] == [None] * 4
    b2u = hf_bytes_to_unicode()
    for b in range(256):  # the byte alphabet
        assert texts[base_tok.convert_tokens_to_ids(b2u[b])] == bytes([b])
    back = checked = 0
    for i in range(4, len(base_tok)):
        try:
            s = texts[i].decode("utf-8")
        except UnicodeDecodeError:
            continue
        checked += 1
        back += base_tok(s, add_special_tokens=False).input_ids == [i]
    assert checked > 1500 and back >= 0.95 * checked
    for text in TEXTS:
        ids = base_tok(text, add_special_tokens=False).input_ids
        assert b"".join(texts[i] for i in ids) == text.encode(), text


def test_token_texts_added_tokens(new_dirs):
    from tokenizers import AddedToken

    tok = AutoTokenizer.from_pretrained(new_dirs["unigram"])
    tok.add_tokens(["blood sugar"])  # normalized: matched in the normalized text
    tok.add_tokens([AddedToken("<raw>", normalized=False)])
    tok.add_special_tokens({"additional_special_tokens": ["<mask>"]})
    texts = token_texts(tok)
    (i,) = tok("blood sugar", add_special_tokens=False).input_ids
    assert texts[i] == b" blood sugar"
    ids = tok("high blood sugar<raw>", add_special_tokens=False).input_ids
    assert i in ids and b"".join(texts[j] for j in ids) == b" high blood sugar<raw>"
    assert texts[tok.convert_tokens_to_ids("<mask>")] is None


def test_unsupported_style_raises():
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer, models, pre_tokenizers

    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok = PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]")
    with pytest.raises(ValueError, match="neither byte-level"):
        token_texts(tok)


# ----------------------------------------------------------------------------- embeddings


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_adapt_untied_matches_reference(new_dirs, base_tok, model_type):
    new = AutoTokenizer.from_pretrained(new_dirs[model_type])
    # An extra special token without a role (fallback) and a plain added token.
    new.add_special_tokens({"additional_special_tokens": ["<mask>"]})
    new.add_tokens(["chest pain"])
    ids = dict(pad_token_id=base_tok.pad_token_id, bos_token_id=base_tok.bos_token_id,
               eos_token_id=base_tok.eos_token_id)
    model = tiny_model("llama", vocab_size=len(base_tok), dtype=torch.float64, **ids)
    base_model = copy.deepcopy(model)
    W_in = model.get_input_embeddings().weight.detach().clone()
    W_out = model.get_output_embeddings().weight.detach().clone()
    assert not torch.equal(W_in, W_out)

    stats = adapt_embeddings(model, base_tok, new)

    ref_in, kinds = _reference(W_in, base_tok, new)
    ref_out, _ = _reference(W_out, base_tok, new)
    got_in = model.get_input_embeddings().weight
    got_out = model.get_output_embeddings().weight
    assert got_in.shape == (len(new), W_in.shape[1]) and got_in.dtype == torch.float64
    assert got_out.shape == (len(new), W_in.shape[1])
    torch.testing.assert_close(got_in, ref_in, atol=1e-12, rtol=0)
    torch.testing.assert_close(got_out, ref_out, atol=1e-12, rtol=0)
    assert stats == {"vocab_size_base": len(base_tok), "vocab_size_new": len(new),
                     "tied": False, **kinds}
    assert kinds["fallback"] == 1 and kinds["special"] == 4
    assert kinds["copied"] > 50 and kinds["mean_of_pieces"] > 20
    torch.testing.assert_close(got_in[new.convert_tokens_to_ids("<mask>")], W_in.mean(0),
                               atol=1e-12, rtol=0)

    # config, generation config, and the embedding module agree with the new tokenizer
    assert model.config.vocab_size == len(new)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) \
        == (new.pad_token_id, new.bos_token_id, new.eos_token_id)
    gen = model.generation_config
    assert (gen.pad_token_id, gen.bos_token_id, gen.eos_token_id) \
        == (new.pad_token_id, new.bos_token_id, new.eos_token_id)
    assert model.get_input_embeddings().num_embeddings == len(new)

    # A sentence of new tokens that are each one base token runs like the base model on
    # those base tokens: same hidden states, so the copied logits columns are identical.
    b2u = hf_bytes_to_unicode()
    copied = {}
    for i in range(4, len(new)):
        data = _piece_bytes(new.convert_ids_to_tokens(i))
        try:
            b = base_tok(data.decode(), add_special_tokens=False).input_ids
        except UnicodeDecodeError:
            b = [base_tok.convert_tokens_to_ids(b2u[data[0]])]
        if len(b) == 1:
            copied[i] = b[0]
    new_ids = sorted(copied)[:: max(1, len(copied) // 20)][:20]
    x_new = torch.tensor([new_ids])
    x_base = torch.tensor([[copied[i] for i in new_ids]])
    model.eval()
    base_model.eval()
    with torch.no_grad():
        out_new = model(input_ids=x_new).logits
        out_base = base_model(input_ids=x_base).logits
    assert out_new.shape == (1, len(new_ids), len(new))
    cols = list(copied)
    torch.testing.assert_close(out_new[..., cols], out_base[..., [copied[i] for i in cols]],
                               atol=1e-10, rtol=0)
    # and a forward/backward with a text of the new tokenizer works
    batch = new(["Patient reports chest pain. café 日本"], return_tensors="pt")
    model.train()
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss) and model.get_input_embeddings().weight.grad is not None


def test_adapt_tied_stays_tied(new_dirs, base_tok):
    new = AutoTokenizer.from_pretrained(new_dirs["bpe"])
    model = tiny_model("gemma", vocab_size=len(base_tok), dtype=torch.float64,
                       tie_word_embeddings=True, pad_token_id=2, bos_token_id=0, eos_token_id=1)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    W = model.get_input_embeddings().weight.detach().clone()
    stats = adapt_embeddings(model, base_tok, new)
    assert stats["tied"] is True
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    assert out.weight is inp.weight and out.weight.data_ptr() == inp.weight.data_ptr()
    ref, _ = _reference(W, base_tok, new)
    torch.testing.assert_close(inp.weight, ref, atol=1e-12, rtol=0)
    logits = model(input_ids=torch.tensor([[5, 100, 399]])).logits
    assert logits.shape == (1, 3, len(new))


def test_adapt_float32_keeps_dtype_and_pad_falls_back_to_eos(new_dirs, base_tok):
    new = AutoTokenizer.from_pretrained(new_dirs["unigram"])
    base = AutoTokenizer.from_pretrained(BASE_DIR)
    base.pad_token = None  # a base without pad: new <pad> takes the base's eos row
    assert base.pad_token_id is None
    model = tiny_model("qwen2", vocab_size=len(base), dtype=torch.float32)
    W = model.get_input_embeddings().weight.detach().clone()
    adapt_embeddings(model, base, new)
    got = model.get_input_embeddings().weight
    assert got.dtype == torch.float32
    ref, kinds = _reference(W, base, new)
    assert torch.equal(got[new.pad_token_id], W[base.eos_token_id])
    torch.testing.assert_close(got, ref.to(torch.float32), atol=1e-7, rtol=0)
    # copied rows are exact copies
    for i in range(4, 260):  # byte pieces: one byte token of the byte-level base each
        assert any(torch.equal(got[i], W[j]) for j in range(4, 260))


def test_metaspace_base_copies_shared_pieces(new_dirs):
    """A SentencePiece-style base (dummy prefix): a new piece that is also a base piece
    copies its row (the base is not fed "▁▁word")."""
    base = AutoTokenizer.from_pretrained(new_dirs["bpe"])
    new = AutoTokenizer.from_pretrained(new_dirs["unigram"])
    model = tiny_model("llama", vocab_size=len(base), dtype=torch.float64)
    W = model.get_input_embeddings().weight.detach().clone()
    adapt_embeddings(model, base, new)
    got = model.get_input_embeddings().weight
    base_vocab = base.get_vocab()
    pieces = new.convert_ids_to_tokens(list(range(len(new))))
    assert pieces[4:260] == [f"<0x{b:02X}>" for b in range(256)]
    shared = [(i, base_vocab[p]) for i, p in enumerate(pieces) if p in base_vocab and i >= 260]
    assert len(shared) > 60 and any(pieces[i].startswith(SP) for i, _ in shared)
    for i, j in shared:
        assert torch.equal(got[i], W[j]), pieces[i]
    for b in range(0x80, 0x100):  # a lone non-ASCII byte: the base's byte piece
        assert torch.equal(got[4 + b], W[base_vocab[pieces[4 + b]]])
    # an ASCII byte is text: the base's piece for that character ("a" -> "a", " " -> "▁")
    assert torch.equal(got[4 + ord("a")], W[base_vocab["a"]])
    assert torch.equal(got[4 + ord(" ")], W[base_vocab[SP]])


# ----------------------------------------------------------------------------- build + load


def _pretrained(tmp_path, base_tok, family="llama"):
    return build_tiny_model(tmp_path / "pretrained", tiny_model_config(family),
                            vocab_size=len(base_tok), pad_token_id=base_tok.pad_token_id,
                            bos_token_id=base_tok.bos_token_id,
                            eos_token_id=base_tok.eos_token_id)


def test_build_adapted_model_folder(tmp_path, new_dirs, base_tok):
    pre = _pretrained(tmp_path, base_tok)
    out, stats = build_adapted_model(pre, BASE_DIR, new_dirs["unigram"], tmp_path / "adapted")
    assert vocab_adaptation_stats(out) == stats
    new = AutoTokenizer.from_pretrained(out)  # a complete model + tokenizer folder
    assert len(new) == stats["vocab_size_new"] == 400
    assert (pathlib.Path(out) / "spm.model").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.get_input_embeddings().num_embeddings == len(new)
    base_model = AutoModelForCausalLM.from_pretrained(pre)
    expected = copy.deepcopy(base_model)
    adapt_embeddings(expected, base_tok, AutoTokenizer.from_pretrained(new_dirs["unigram"]))
    for (n, p), (_, q) in zip(model.named_parameters(), expected.named_parameters()):
        assert torch.equal(p, q), n
    mtime = (pathlib.Path(out) / ADAPTED_MARKER).stat().st_mtime_ns
    out2, stats2 = build_adapted_model(pre, BASE_DIR, new_dirs["unigram"], tmp_path / "adapted")
    assert (out2, stats2) == (out, stats)
    assert (pathlib.Path(out) / ADAPTED_MARKER).stat().st_mtime_ns == mtime
    # another tokenizer into the same folder rebuilds it
    _, stats3 = build_adapted_model(pre, BASE_DIR, new_dirs["bpe"], tmp_path / "adapted")
    assert vocab_adaptation_stats(out) == stats3
    assert (pathlib.Path(out) / ADAPTED_MARKER).stat().st_mtime_ns != mtime


def test_load_model_with_base_tokenizer(tmp_path, new_dirs, base_tok):
    pre = _pretrained(tmp_path, base_tok)
    cache = tmp_path / "cache"
    cfg = ModelConfig(init="pretrained", name_or_path=pre, tokenizer=new_dirs["bpe"],
                      base_tokenizer=BASE_DIR)
    model, tok = load_model(cfg, cache_dir=cache)
    assert len(tok) == 400 and model.get_input_embeddings().num_embeddings == len(tok)
    assert model.get_output_embeddings().weight.shape[0] == len(tok)
    stats = model.llmdp_vocab_adaptation
    assert stats["vocab_size_new"] == len(tok) and stats["vocab_size_base"] == len(base_tok)
    (built,) = [p for p in cache.iterdir() if p.name.startswith("adapted-")]
    assert vocab_adaptation_stats(built) == stats
    assert model.config.pad_token_id == tok.pad_token_id
    batch = tok(["chest pain, fever"], return_tensors="pt")
    assert torch.isfinite(model(**batch, labels=batch["input_ids"]).loss)

    marker = built / ADAPTED_MARKER
    mtime = marker.stat().st_mtime_ns
    cfg2 = ModelConfig(init="pretrained", name_or_path=pre, tokenizer=new_dirs["bpe"],
                       base_tokenizer=BASE_DIR,
                       lora=LoraConfig(r=2, target_modules=("q_proj", "v_proj")))
    model2, _ = load_model(cfg2, cache_dir=cache)
    assert marker.stat().st_mtime_ns == mtime
    assert [p.name for p in cache.iterdir() if p.name.startswith("adapted-")] == [built.name]
    assert model2.llmdp_vocab_adaptation == stats
    emb = model2.get_input_embeddings().weight
    assert torch.equal(emb, model.get_input_embeddings().weight)

    # Without base_tokenizer nothing is adapted.
    plain, _ = load_model(ModelConfig(init="pretrained", name_or_path=pre, tokenizer=BASE_DIR),
                          cache_dir=cache)
    assert not hasattr(plain, "llmdp_vocab_adaptation")
    assert plain.get_input_embeddings().num_embeddings == len(base_tok)


def test_config_base_tokenizer_needs_pretrained(tmp_path):
    d = {
        "model": {"init": "tiny", "tokenizer": BASE_DIR, "base_tokenizer": BASE_DIR},
        "data": {"path": "corpus.jsonl"},
        "privacy": {"noise_multiplier": 1.0},
        "train": {"steps": 10},
    }
    with pytest.raises(ConfigError, match=r"model\.base_tokenizer") as info:
        recipe_from_dict(d, base_dir=tmp_path)
    assert getattr(info.value, "key", "model.base_tokenizer") == "model.base_tokenizer"
    d["model"] = {"init": "pretrained", "name_or_path": BASE_DIR, "tokenizer": BASE_DIR,
                  "base_tokenizer": BASE_DIR}
    assert recipe_from_dict(d, base_dir=tmp_path).model.base_tokenizer == BASE_DIR
