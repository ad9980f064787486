"""Tokenizers the `tokenizers` library runs: a checkpoint's `tokenizer.json` (what transformers
saves: byte-level BPE as in SmolLM/SmolLM2, DeepSeek and most fine-tunes, or SentencePiece-style
BPE with byte fallback), or the byte-level BPE vocabulary a GGUF file carries
(`tokenizer.ggml.model: gpt2`, built by gguf_vocab.py).

Whether `encode(text, bos=True)` starts with a BOS token follows the checkpoint: its
`tokenizer_config.json` `add_bos_token` (else whether tokenizer.json's post-processor adds one),
a GGUF's `tokenizer.ggml.add_bos_token`. SmolLM2 adds none.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Sequence

from llama_jax.errors import CheckpointError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


class JsonTokenizer:
    """A `tokenizers.Tokenizer` behind llama_jax's Tokenizer interface."""

    def __init__(self, tokenizer, path: Path, bos_token: str | None, eos_tokens: Sequence[str],
                 add_bos: bool, byte_level: bool):
        """`byte_level`: its pieces are written in byte-level BPE's alphabet (GPT-2's)."""
        self._tok = tokenizer
        self.path = path
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in sorted(added.items()) if t.special}
        self.special_ids = frozenset(self.special_tokens.values())
        self.bos_id = self._id(bos_token) if bos_token else None
        self.eos_ids = tuple(dict.fromkeys(self._id(t) for t in eos_tokens if t))
        self._add_bos = add_bos and self.bos_id is not None
        self.byte_level = byte_level

    def id_to_token(self, id: int) -> str:
        return self._tok.id_to_token(id)

    def merges(self) -> list[str]:
        """The BPE merges, "left right" each, in rank order."""
        merges = json.loads(self._tok.to_str())["model"].get("merges") or []
        return [m if isinstance(m, str) else " ".join(m) for m in merges]

    def adds_bos(self) -> bool:
        return self._add_bos

    def files(self) -> dict[str, bytes]:
        """The files `from_directory` reads back as this tokenizer (a GGUF vocabulary's too):
        tokenizer.json and the tokenizer_config.json of its BOS, first EOS and BOS rule."""
        settings = {"bos_token": None if self.bos_id is None else self.id_to_token(self.bos_id),
                    "eos_token": self.id_to_token(self.eos_ids[0]) if self.eos_ids else None,
                    "add_bos_token": self._add_bos}
        return {TOKENIZER_JSON: self._tok.to_str().encode(),
                TOKENIZER_CONFIG: (json.dumps(settings, indent=2) + "\n").encode()}

    def _id(self, token: str) -> int:
        found = self._tok.token_to_id(token)
        if found is None:
            raise CheckpointError(f"{self.path}: token {token!r} is not in the vocabulary")
        return found

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """`bos` adds BOS only where the checkpoint's tokenizer begins sequences with one."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * (bos and self._add_bos) + ids + list(self.eos_ids[:1]) * eos

    def decode(self, ids: Sequence[int]) -> str:
        known = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(known, skip_special_tokens=True)

    def token_bytes(self, id: int) -> bytes:
        if not 0 <= id < self.vocab_size or id in self.special_ids:
            return b""
        piece = self._tok.id_to_token(id)
        if self.byte_level:
            return bytes(_byte_of_char()[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet: the printable character each byte is written as (GPT-2's
    table: printable Latin-1 bytes as themselves, the others shifted past U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}
    return {c: b for b, c in chars.items()}


def tokenizers_library():
    """The `tokenizers` package, or the error that says how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise CheckpointError("tokenizer.json and GGUF vocabularies need the tokenizers "
                              "package (pip install 'llama_jax[tokenizers]')") from None
    return tokenizers


def has_tokenizer_json(directory: Path) -> bool:
    return (directory / TOKENIZER_JSON).is_file()


def from_directory(directory: Path) -> JsonTokenizer:
    """The tokenizer of a checkpoint directory holding `tokenizer.json` (and usually
    `tokenizer_config.json`: the BOS/EOS tokens and whether BOS is added)."""
    file = directory / TOKENIZER_JSON
    try:
        tokenizer = tokenizers_library().Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for unreadable files
        raise CheckpointError(f"{file}: not a tokenizer.json the tokenizers library reads: "
                              f"{e}") from None
    spec = json.loads(tokenizer.to_str())  # its pipeline as written, read once
    settings = read_settings(directory / TOKENIZER_CONFIG)
    bos, eos = (token_text(settings.get(k)) for k in ("bos_token", "eos_token"))
    add_bos = settings.get("add_bos_token")
    if add_bos is None:  # as the post-processor does it (Llama's TemplateProcessing adds <s>)
        add_bos = bos is not None and bos in json.dumps(spec.get("post_processor") or {})
    byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    return JsonTokenizer(tokenizer, file, bos, [eos], bool(add_bos), byte_level)


def read_settings(file: Path) -> dict:
    """A JSON settings file beside a tokenizer (tokenizer_config.json); {} when absent."""
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from None


def token_text(token) -> str | None:
    """tokenizer_config.json writes a token as its text or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token
