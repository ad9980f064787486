"""tokenizer.json directories and GGUF vocabularies, through the `tokenizers` library: ids equal
transformers' on real text (the standard library's own source and docs), BOS as the checkpoint
says, streaming detokenization equal to decoding, bad files refused naming the file."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from corpus import STDLIB  # noqa: E402
from llama_jax import load_tokenizer  # noqa: E402
from llama_jax.data.tokenizer import TextStream  # noqa: E402
from llama_jax.errors import CheckpointError  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@functools.cache
def texts() -> list[str]:
    files = sorted(STDLIB.glob("[a-m]*.py"))[:24]
    return [f.read_text(errors="replace")[:4000] for f in files]


SAMPLE = ("Grüße, ça va? 日本語のテキスト 🙂 x=12345\n\tdef f(a, b):  return a ** b\n"
          "<|im_start|>user\nhi<|im_end|>")


def assert_streams_as_decoded(tokenizer, ids: list[int]) -> None:
    stream = TextStream(tokenizer)
    assert "".join(stream.push([i]) for i in ids) + stream.flush() == tokenizer.decode(ids)


@functools.cache  # trained once; never changed after
def byte_level() -> "tokenizers.Tokenizer":
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    return tok


@functools.cache
def byte_fallback() -> "tokenizers.Tokenizer":
    """SentencePiece-style BPE: ▁ for spaces, unknown characters as <0xNN> byte pieces."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Sequence([
        tokenizers.decoders.Replace("\u2581", " "), tokenizers.decoders.ByteFallback(),
        tokenizers.decoders.Fuse()])
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] + [
            f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(texts(), trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def save(tok, directory: Path, settings: dict) -> Path:
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **settings}))
    return directory


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_a_tokenizer_json_directory_encodes_as_transformers_does(tmp_path, kind):
    if kind == "byte_level":
        directory = save(byte_level(), tmp_path / kind,
                         {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                          "add_bos_token": False})
        bos, eos = None, "<|im_end|>"
    else:  # no add_bos_token: the post-processor's template adds <s>
        directory = save(byte_fallback(), tmp_path / kind, {"bos_token": "<s>",
                                                            "eos_token": "</s>"})
        bos, eos = "<s>", "</s>"
    ours = load_tokenizer(directory)
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    for text in [*texts()[:10], SAMPLE]:
        ids = ours.encode(text)
        assert ids == reference(text).input_ids
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert_streams_as_decoded(ours, ids)
    # each token's own bytes (the server's logprobs) add up to the text
    ids = ours.encode(texts()[0] + SAMPLE[:40], bos=False)
    assert b"".join(ours.token_bytes(i) for i in ids) == ours.decode(ids).encode()
    assert ours.eos_ids == (reference.convert_tokens_to_ids(eos),)
    assert (ours.encode("a", bos=True)[0] == ours.bos_id) == (bos is not None)
    assert ours.special_ids >= {reference.convert_tokens_to_ids(eos)}


def write_vocabulary(path: Path, tok) -> None:
    """A GGUF with only a byte-level BPE vocabulary, as llama.cpp's converter writes one."""
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, (list, tuple)) else m
              for m in json.loads(tok.to_str())["model"]["merges"]]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_vocabulary_encodes_as_transformers_reads_it(tmp_path):
    path = tmp_path / "vocab.gguf"
    write_vocabulary(path, byte_level())
    ours = load_tokenizer(path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [*texts()[10:20], SAMPLE]:
        ids = ours.encode(text)
        assert ids == reference(text).input_ids
        assert_streams_as_decoded(ours, ids)
    assert ours.eos_ids == (reference.convert_tokens_to_ids("<|im_end|>"),)
    assert ours.bos_id == reference.convert_tokens_to_ids("<|im_start|>")
    assert ours.encode("hi")[0] != ours.bos_id  # add_bos_token false


def test_bad_tokenizer_files_are_refused_naming_the_file(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(CheckpointError, match=f"{broken / 'tokenizer.json'}: not a tokenizer"):
        load_tokenizer(broken)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("not a model")
    with pytest.raises(CheckpointError, match=f"{not_gguf}: not a GGUF file"):
        load_tokenizer(not_gguf)
    for model, message in (("rwkv", "tokenizer.ggml.model is 'rwkv'"),
                           ("llama", "tokenizer.ggml.tokens is missing")):
        vocab = tmp_path / f"{model}.gguf"
        writer = gguf.GGUFWriter(str(vocab), "llama")
        writer.add_tokenizer_model(model)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(CheckpointError, match=f"{vocab}: {message}"):
            load_tokenizer(vocab)
