"""Tokenizers: SentencePiece (LLaMA 1/2) with ids from the model file, and the LLaMA 3 tiktoken
tokenizer against Meta's own implementation (the llama-models package ships both file and code)."""

import io
import itertools
from pathlib import Path

import pytest

from llama_jax.errors import CheckpointError
from llama_jax.data.tokenizer import Llama3Tokenizer, SentencePieceTokenizer, TextStream, load_tokenizer

TEXT = ("The quick brown fox jumps over the lazy dog. Émile's café served 3.14159 crêpes! "
        "def f(x):\n    return x ** 2  # <|begin_of_text|> is just text here\n\n\t naïve — 東京")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm

    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    corpus = [TEXT, "A sentence about foxes and dogs.", "Numbers: 1 2 3 4 5 6 7 8 9 10."] * 50
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=model,
                                   vocab_size=400, model_type="bpe", byte_fallback=True,
                                   unk_id=0, bos_id=3, eos_id=7, pad_id=-1, minloglevel=2,
                                   normalization_rule_name="identity",  # as LLaMA's
                                   remove_extra_whitespaces=False, split_digits=True,
                                   user_defined_symbols=["<a>", "<b>", "<c>", "<d>"])
    path.write_bytes(model.getvalue())
    return path


def test_sentencepiece_ids_come_from_the_model_file(sp_model):
    tok = load_tokenizer(sp_model.parent)  # a directory: picks tokenizer.model
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.bos_id, tok.eos_ids, tok.vocab_size) == (3, (7,), 400)
    assert tok.special_ids == {3, 7}  # the control pieces (<unk> decodes to text: not one)
    ids = tok.encode(TEXT, bos=True, eos=True)
    assert ids[0] == 3 and ids[-1] == 7
    assert tok.decode(ids[1:-1]) == TEXT  # byte fallback: lossless, even for unseen characters


def test_text_stream_continues_the_prompt_exactly(sp_model):
    """Pieces arrive a few at a time; the printed text is exactly what decoding prompt +
    continuation adds to the prompt's text (its leading space included), never a broken
    character."""
    tok = load_tokenizer(sp_model)
    ids = tok.encode(TEXT, bos=False)
    for cut, n in itertools.product((1, 7, 23), (1, 2, 3)):  # n ids a push
        stream = TextStream(tok, ids[:cut])
        pieces = [stream.push(ids[i:i + n]) for i in range(cut, len(ids), n)]
        assert all("\ufffd" not in piece for piece in pieces)
        assert tok.decode(ids[:cut]) + "".join(pieces) + stream.flush() == TEXT
    # a control token (no text of its own) amid the text, before a word's space, wherever
    # the stream may move its context
    for at in (i for i in range(1, 40) if tok.token_bytes(ids[i]).startswith(b" ")):
        with_control = ids[:at] + [tok.bos_id] + ids[at:]
        stream = TextStream(tok, with_control[:1])
        pieces = [stream.push([i]) for i in with_control[1:]]
        assert tok.decode(with_control[:1]) + "".join(pieces) + stream.flush() == TEXT, at


@pytest.fixture(scope="module")
def llama3_file():
    llama_models = pytest.importorskip("llama_models")
    return Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"


def test_llama3_tokenizer_matches_meta(llama3_file):
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

    ours, meta = load_tokenizer(llama3_file), MetaTokenizer(llama3_file)
    assert isinstance(ours, Llama3Tokenizer)
    assert ours.vocab_size == meta.n_words == 128256
    assert ours.bos_id == meta.bos_id == 128000
    assert set(ours.eos_ids) == set(meta.stop_tokens) == {128001, 128008, 128009}
    assert ours.special_tokens == meta.special_tokens
    assert ours.special_ids == set(range(128000, 128256))
    assert ours.encode("Hello world", bos=True) == [128000, 9906, 1917]
    for text in (TEXT, "   leading spaces", "a\n\n\nb", "1234567 numbers", ""):
        assert ours.encode(text, bos=True, eos=True) == meta.encode(
            text, bos=True, eos=True, allowed_special=set(), disallowed_special=())
        assert ours.decode(ours.encode(text, bos=False)) == text


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer file"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="not a SentencePiece model"):
        load_tokenizer(tmp_path)
