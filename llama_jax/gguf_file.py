"""GGUF files (llama.cpp's format) opened with the `gguf` package: telling one apart by its
magic, its memory-mapped reader, and its key-value metadata as Python values. What the file
holds is read by the layers that own it: the weights by formats/gguf.py, the vocabulary by
data/json_tokenizer.py, the chat template by data/chat_template.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_jax.errors import CheckpointError

MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    """A file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def open_file(path: Path):
    """`gguf.GGUFReader` over the file (memory-mapped)."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the gguf package "
                              "(pip install 'llama_jax[gguf]')") from None
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct or numpy errors on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file: {e}") from None


def metadata(reader) -> dict[str, Any]:
    """The file's key-value metadata as Python values (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}


def token_named(kv: dict[str, Any], id_key: str) -> str | None:
    """The vocabulary's token whose id the key `tokenizer.ggml.<id_key>` holds (e.g.
    "eos_token_id"); None when the file has no such key or vocabulary."""
    tokens = kv.get("tokenizer.ggml.tokens") or ()
    i = kv.get(f"tokenizer.ggml.{id_key}")
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None
