"""Writing files and directories so that a crash never leaves a half-written one in place:
write a hidden sibling (named with the process id, so concurrent processes do not collide),
then rename it over the target in one step."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from llama_jax.errors import CheckpointError


def sibling_temp(path: Path) -> Path:
    """The hidden temporary name beside `path` that this process writes before renaming."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomically(path: Path, data: bytes | str) -> None:
    """Replaces `path` with `data` (bytes, or text written as UTF-8) in one rename."""
    temp = sibling_temp(path)
    if isinstance(data, str):
        temp.write_text(data, encoding="utf-8")
    else:
        temp.write_bytes(data)
    os.replace(temp, path)


def keep_file(path: Path, data: bytes) -> None:
    """`write_atomically`, creating the directory, unless `path` already holds `data`."""
    if not path.is_file() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, data)


def check_new_directory(dst: Path) -> None:
    """`dst` may be written: it does not exist, or is an empty directory."""
    if dst.is_dir() and not any(dst.iterdir()):
        return
    if dst.exists():
        raise CheckpointError(f"{dst}: already exists and is not an empty directory; refusing "
                              "to overwrite it")


@contextlib.contextmanager
def atomic_directory(dst: str | Path) -> Iterator[Path]:
    """Yields an empty hidden directory beside `dst` that becomes `dst` only if the block
    succeeds (replacing `dst` if it is an empty directory); a non-empty `dst` is refused and
    never touched, and a failure leaves nothing behind."""
    dst = Path(dst)
    check_new_directory(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling_temp(dst)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
