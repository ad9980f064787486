"""A small real-text corpus for tests, available wherever Python is: modules of the standard
library (code, docstrings and comments written by people), one document per file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

STDLIB = Path(json.__file__).resolve().parent.parent


def make_corpus(root: Path, n_docs: int = 60, max_bytes: int = 30_000) -> Path:
    """Copies `n_docs` stdlib modules of 4–30 kB (sorted by name) into `root/docs`, plus a
    hidden file that the corpus reader must skip."""
    docs = root / "docs"
    (docs / "sub").mkdir(parents=True)
    chosen = [p for p in sorted(STDLIB.glob("*.py")) if 4_000 < p.stat().st_size < max_bytes]
    for i, path in enumerate(chosen[:n_docs]):
        shutil.copyfile(path, docs / ("sub" if i % 3 == 0 else "") / f"{path.stem}.txt")
    (docs / ".hidden.txt").write_text("never read")
    return docs
