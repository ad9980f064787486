"""Tokenizers as GGUF vocabularies (`tokenizer.ggml.*`), both ways.

- `gpt2`: byte-level BPE (tokens, merges, token types), read and written for `tokenizer.json`
  tokenizers (json_tokenizer.py).
- `llama`: a SentencePiece model as llama.cpp stores one (each piece with its score and type),
  written from a `tokenizer.model` and read back as a SentencePiece BPE model with byte
  fallback and no normalization (what LLaMA's and this library's models are), built from the
  pieces by SentencePiece's own model proto.
"""

from __future__ import annotations

from pathlib import Path

from llama_jax.data.json_tokenizer import JsonTokenizer, tokenizers_library
from llama_jax.errors import CheckpointError
from llama_jax.gguf_file import token_named

# llama.cpp's token types, which are SentencePiece's piece types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def byte_level_tokenizer(path: Path, kv: dict) -> JsonTokenizer:
    """The `gpt2` (byte-level BPE) vocabulary of a GGUF file's metadata `kv`, as transformers
    converts it: GPT-2's pre-tokenizer and byte-level decoder, the control and user-defined
    tokens added (control ones special)."""
    tokenizers = tokenizers_library()
    tokens = list(kv["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in kv.get("tokenizer.ggml.merges", ())]
    types = list(kv.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(
        {t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False))
    prefix = bool(kv.get("tokenizer.ggml.add_space_prefix", False))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=prefix)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([tokenizers.AddedToken(t, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    return JsonTokenizer(tokenizer, path, token_named(kv, "bos_token_id"),
                         [token_named(kv, "eos_token_id"), token_named(kv, "eot_token_id")],
                         bool(kv.get("tokenizer.ggml.add_bos_token", False)), byte_level=True)


def sentencepiece_proto(path: Path, kv: dict) -> bytes:
    """The serialized SentencePiece model of a GGUF file's `llama` vocabulary (`kv`: the
    file's metadata)."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    tokens = list(kv.get("tokenizer.ggml.tokens") or ())
    if not tokens:
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens is missing")
    scores = list(kv.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    types = list(kv.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    proto = spm.ModelProto()
    for token, score, kind in zip(tokens, scores, types):
        proto.pieces.add(piece=token, score=float(score), type=int(kind))
    trainer = proto.trainer_spec
    trainer.model_type = spm.TrainerSpec.BPE
    trainer.byte_fallback = BYTE in types
    for field, key in (("unk_id", "unknown_token_id"), ("bos_id", "bos_token_id"),
                       ("eos_id", "eos_token_id")):
        setattr(trainer, field, int(kv.get(f"tokenizer.ggml.{key}", -1)))
    trainer.pad_id = int(kv.get("tokenizer.ggml.padding_token_id", -1))
    if trainer.pad_id in (trainer.unk_id, trainer.bos_id, trainer.eos_id):
        trainer.pad_id = -1  # SentencePiece wants a piece of its own for padding
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = bool(kv.get("tokenizer.ggml.add_space_prefix", True))
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    return proto.SerializeToString()


def add_vocabulary(writer, tokenizer, where: object) -> None:
    """Writes a tokenizer into a `gguf.GGUFWriter` as llama.cpp reads it: a SentencePiece one
    (it has `model_proto`) or a byte-level `tokenizer.json` one; any other (tiktoken's) is
    refused naming `where`."""
    if hasattr(tokenizer, "model_proto"):
        _add_sentencepiece(writer, tokenizer)
    elif isinstance(tokenizer, JsonTokenizer) and tokenizer.byte_level:
        _add_byte_level(writer, tokenizer)
    else:
        raise CheckpointError(f"{where}: its tokenizer ({type(tokenizer).__name__}) has no GGUF "
                              "form here (SentencePiece and byte-level BPE do)")


def _add_sentencepiece(writer, tokenizer) -> None:
    from sentencepiece import sentencepiece_model_pb2 as spm

    proto = spm.ModelProto.FromString(tokenizer.model_proto())
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([p.piece for p in proto.pieces])
    writer.add_token_scores([p.score for p in proto.pieces])
    writer.add_token_types([int(p.type) for p in proto.pieces])
    trainer = proto.trainer_spec
    for add, i in ((writer.add_unk_token_id, trainer.unk_id), (writer.add_bos_token_id,
                                                               trainer.bos_id),
                   (writer.add_eos_token_id, trainer.eos_id)):
        if i >= 0:
            add(i)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)


def _add_byte_level(writer, tokenizer: JsonTokenizer) -> None:
    tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if i in tokenizer.special_ids else NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges(tokenizer.merges())
    if tokenizer.bos_id is not None:
        writer.add_bos_token_id(tokenizer.bos_id)
    if tokenizer.eos_ids:
        writer.add_eos_token_id(tokenizer.eos_ids[0])
    writer.add_add_bos_token(tokenizer.adds_bos())
