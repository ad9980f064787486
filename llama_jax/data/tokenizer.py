"""Tokenizers of the LLaMA family, behind one small interface.

- LLaMA 1/2: a SentencePiece `tokenizer.model` (BPE with byte fallback); BOS/EOS ids come from
  the model file.
- LLaMA 3.x: Meta's `tokenizer.model` in tiktoken's BPE-ranks format (128000 tokens) plus 256
  special tokens (`<|begin_of_text|>` = 128000, ...), with LLaMA 3's pre-split pattern. Needs
  the optional `tiktoken` package (`pip install 'llama_jax[llama3]'`).

`load_tokenizer(path)` takes the file or a checkpoint directory holding `tokenizer.model`, and
tells the two formats apart by content (tiktoken files are lines of `base64 rank`). A directory
with only a `tokenizer.json` is read by the `tokenizers` library (json_tokenizer.py), a GGUF
file's vocabulary by gguf_vocab.py.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from typing import Iterable, Protocol, Sequence

from llama_jax.errors import CheckpointError
from llama_jax.files import keep_file

TOKENIZER_FILE = "tokenizer.model"

# Meta's LLaMA 3 pre-tokenizer pattern and special tokens (llama-models, llama3/tokenizer.py).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NAMED_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
    "<|image|>",
)
LLAMA3_NUM_SPECIALS = 256
# tiktoken panics on very long inputs; Meta encodes in chunks of this many characters.
_MAX_ENCODE_CHARS = 400_000
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+\r?$")


class Tokenizer(Protocol):
    path: Path  # the tokenizer.model it was read from
    vocab_size: int
    bos_id: int
    eos_ids: tuple[int, ...]  # every id that ends generation
    special_ids: frozenset[int]  # control tokens (BOS, EOS, ...): no text of their own
    special_tokens: dict[str, int]  # the control tokens' names ("<s>", "<|eot_id|>", ...)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, id: int) -> bytes:
        """The UTF-8 bytes one token stands for (part of a character, for a byte-fallback
        piece); none for control tokens and ids past the vocabulary."""


class SentencePieceTokenizer:
    def __init__(self, path: Path, model_proto: bytes | None = None):
        """The model in the file at `path`, or the serialized `model_proto` read from it."""
        import sentencepiece

        try:
            self._sp = (sentencepiece.SentencePieceProcessor(model_file=str(path))
                        if model_proto is None else
                        sentencepiece.SentencePieceProcessor(model_proto=model_proto))
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: not a SentencePiece model: {e}") from None
        self.path = path
        self.vocab_size = self._sp.vocab_size()
        self.bos_id = self._sp.bos_id()
        self.eos_ids = (self._sp.eos_id(),)
        self.special_ids = frozenset(i for i in range(self.vocab_size) if self._sp.is_control(i))
        self.special_tokens = {self._sp.id_to_piece(i): i for i in sorted(self.special_ids)}

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self._sp.encode(text)
        return [self.bos_id] * bos + ids + list(self.eos_ids[:1]) * eos

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(_known(ids, self.vocab_size))

    def model_proto(self) -> bytes:
        """The SentencePiece model, serialized (its pieces, scores, types and settings)."""
        return self._sp.serialized_model_proto()

    def token_bytes(self, id: int) -> bytes:
        if not 0 <= id < self.vocab_size or id in self.special_ids or self._sp.is_unknown(id):
            return b""
        piece = self._sp.id_to_piece(id)
        if self._sp.is_byte(id):  # "<0xE2>"
            return bytes([int(piece[3:-1], 16)])
        return piece.replace("\u2581", " ").encode()


class Llama3Tokenizer:
    def __init__(self, path: Path):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError:
            raise CheckpointError(f"{path}: the LLaMA 3 tokenizer needs tiktoken "
                                  "(pip install 'llama_jax[llama3]')") from None
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as e:  # tiktoken raises ValueError/binascii errors for bad lines
            raise CheckpointError(f"{path}: not a tiktoken BPE file: {e}") from None
        n_base = len(ranks)
        names = LLAMA3_NAMED_SPECIALS + tuple(
            f"<|reserved_special_token_{2 + i}|>"
            for i in range(LLAMA3_NUM_SPECIALS - len(LLAMA3_NAMED_SPECIALS)))
        self.special_tokens = {name: n_base + i for i, name in enumerate(names)}
        self._enc = tiktoken.Encoding(name=path.name, pat_str=LLAMA3_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.path = path
        self.vocab_size = n_base + len(names)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_ids = tuple(self.special_tokens[t] for t in
                             ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))
        self.special_ids = frozenset(self.special_tokens.values())

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Special-token text in `text` is encoded as ordinary text, never as a control token."""
        ids = [self.bos_id] * bos
        for start in range(0, len(text), _MAX_ENCODE_CHARS):
            ids += self._enc.encode_ordinary(text[start:start + _MAX_ENCODE_CHARS])
        return ids + [self.eos_ids[0]] * eos

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(_known(ids, self.vocab_size))

    def token_bytes(self, id: int) -> bytes:
        if not 0 <= id < self.vocab_size or id in self.special_ids:
            return b""
        return self._enc.decode_single_token_bytes(id)


def _known(ids: Sequence[int], vocab_size: int) -> list[int]:
    """Drops ids the tokenizer has no piece for: models often pad their embedding table past the
    tokenizer's vocabulary, and an untrained model may sample those rows."""
    return [int(i) for i in ids if 0 <= int(i) < vocab_size]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer in `path`: a `tokenizer.model` file, a GGUF file's vocabulary, or a
    checkpoint directory holding `tokenizer.model` or else `tokenizer.json`
    (json_tokenizer.py)."""
    from llama_jax.data import json_tokenizer
    from llama_jax import gguf_file as gguf

    path = Path(path)
    if path.is_dir():
        if not (path / TOKENIZER_FILE).is_file() and json_tokenizer.has_tokenizer_json(path):
            return json_tokenizer.from_directory(path)
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no tokenizer file (expected {TOKENIZER_FILE}, or "
                              f"{json_tokenizer.TOKENIZER_JSON} in its directory)")
    if gguf.is_gguf(path):
        return _gguf_tokenizer(path, gguf.metadata(gguf.open_file(path)))
    if path.suffix == ".gguf":  # named as one: say what it is not, not "not SentencePiece"
        raise CheckpointError(f"{path}: not a GGUF file (it does not start with "
                              f"{gguf.MAGIC.decode()})")
    with path.open("rb") as f:
        first_line = f.readline(1024)
    if _TIKTOKEN_LINE.match(first_line.rstrip(b"\n")):
        return Llama3Tokenizer(path)
    return SentencePieceTokenizer(path)


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """Keeps `tokenizer` in `directory` (a run's workdir) as `tokenizer_files`; a file already
    holding the same bytes is left as it is."""
    for name, content in tokenizer_files(tokenizer).items():
        keep_file(directory / name, content)


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """Files `load_tokenizer(directory)` reads back as `tokenizer`: its model file as
    tokenizer.model (a GGUF's SentencePiece vocabulary serialized alone, not the GGUF), or
    (the tokenizers library's: a tokenizer.json, a GGUF's byte-level vocabulary)
    tokenizer.json and tokenizer_config.json."""
    from llama_jax.data import json_tokenizer
    from llama_jax import gguf_file as gguf

    if isinstance(tokenizer, json_tokenizer.JsonTokenizer):
        return tokenizer.files()
    if isinstance(tokenizer, SentencePieceTokenizer) and gguf.is_gguf(tokenizer.path):
        return {TOKENIZER_FILE: tokenizer.model_proto()}
    return {TOKENIZER_FILE: tokenizer.path.read_bytes()}


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    """A tokenizer's identity, wherever it was read from: its `tokenizer_files`, hashed."""
    digest = hashlib.sha256()
    for name, content in sorted(tokenizer_files(tokenizer).items()):
        digest.update(f"{name}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


def has_tokenizer(path: str | Path) -> bool:
    """Whether `path` holds a tokenizer for `load_tokenizer` to read (which may still find it
    broken): a tokenizer file, a GGUF file with a vocabulary, or a checkpoint directory with
    either tokenizer file."""
    from llama_jax.data import json_tokenizer
    from llama_jax import gguf_file as gguf

    path = Path(path)
    if path.is_dir():
        return (path / TOKENIZER_FILE).is_file() or json_tokenizer.has_tokenizer_json(path)
    if gguf.is_gguf(path):
        return "tokenizer.ggml.model" in gguf.metadata(gguf.open_file(path))
    return path.is_file()


def _gguf_tokenizer(path: Path, kv: dict) -> Tokenizer:
    """The vocabulary of a GGUF file (`kv`: its metadata): byte-level BPE (`gpt2`) or
    SentencePiece (`llama`), gguf_vocab.py."""
    from llama_jax.data import gguf_vocab

    model = kv.get("tokenizer.ggml.model")
    if model == "gpt2":
        return gguf_vocab.byte_level_tokenizer(path, kv)
    if model == "llama":
        return SentencePieceTokenizer(path, gguf_vocab.sentencepiece_proto(path, kv))
    raise CheckpointError(f"{path}: tokenizer.ggml.model is {model!r}; llama_jax reads gpt2 "
                          "(byte-level BPE) and llama (SentencePiece) vocabularies")


def train_sentencepiece(texts: Iterable[str], vocab_size: int) -> bytes:
    """Trains a LLaMA-1/2-style SentencePiece BPE model (byte fallback, digits split, text kept
    verbatim: no whitespace folding, no Unicode normalisation, so code survives a round trip)
    and returns the model file's bytes. Ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOS), as in LLaMA.

    SentencePiece learns from lines; a newline is never part of a piece and encodes through
    byte fallback, exactly as in Meta's tokenizer.
    """
    import sentencepiece

    lines = (line for text in texts for line in text.splitlines() if line.strip())
    model = io.BytesIO()  # not a file prefix: the model would record the (temporary) path
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, split_digits=True, character_coverage=0.9999,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, max_sentence_length=1 << 16, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, num_threads=os.cpu_count() or 1, minloglevel=2)
    return model.getvalue()


_RESTART_AFTER = 16  # ids (context included) a TextStream decodes before it moves its context


class TextStream:
    """Turns a growing list of token ids into text increments for printing as they arrive.
    Holds back a trailing partial UTF-8 character (decoded as U+FFFD) until it completes.

    The ids are decoded after a context and only the text past the context's own decoding is
    returned: SentencePiece drops the space of a sequence's first piece, so a continuation
    decoded alone would lose the space between the prompt and its first word. The context is
    the prompt at first, then a recent token whose text is out: each push decodes a few ids,
    not the whole sequence (which made a long answer's streaming quadratic).
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._ids: list[int] = list(context)  # the context, then the ids whose text is not out
        self._printed = len(tokenizer.decode(self._ids))  # characters of their text out

    def push(self, ids: Sequence[int]) -> str:
        self._ids += ids
        text = self._tokenizer.decode(self._ids)
        stable = len(text.rstrip("\ufffd"))
        new = text[self._printed:stable]
        self._printed = max(self._printed, stable)
        # every id's text is out: decode after the last from now on (every so many ids: a
        # decode is mostly a call's cost, and this one decodes the new context)
        if stable == len(text) == self._printed and len(self._ids) > _RESTART_AFTER:
            self._restart(self._ids[-1:])
        return new

    def _restart(self, context: list[int]) -> None:
        """Decodes after `context` from now on, unless it has no text of its own (a control
        token: SentencePiece would then drop the next piece's space)."""
        printed = len(self._tokenizer.decode(context))
        if printed:
            self._ids, self._printed = context, printed

    def flush(self) -> str:
        text = self._tokenizer.decode(self._ids)
        new, self._printed = text[self._printed:], len(text)
        return new
