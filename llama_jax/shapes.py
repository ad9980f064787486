"""Shape buckets: requests of any size are padded up to a few sizes (powers of two), so a few
compiled programs serve them all — generate's batch, prompt and new-token lengths, the
server's prefill chunks, scoring and prediction batches."""

from __future__ import annotations

from typing import Sequence

import numpy as np

MIN_BUCKET = 16  # the smallest padded length: shorter ones compile no programs of their own


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The next power of two >= max(n, minimum)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def padded_row(ids: Sequence[int], width: int) -> np.ndarray:
    """`ids` as one int32 row `[1, width]`, zeros after them."""
    row = np.zeros((1, width), np.int32)
    row[0, :len(ids)] = ids
    return row
