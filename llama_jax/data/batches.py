"""Batches of token windows for language-model training: packed windows of a token array,
shuffled by grain (whose iterator state is checkpointed with the run), fixed validation batches,
and the model inputs of a packed window (`features`).

- Packing: a training example is a window of T+1 consecutive tokens (window i starts at i·T),
  so documents are packed back to back with no padding. `features` turns windows into inputs,
  targets, positions and segment ids on the device: attention and positions restart at every
  BOS, and a target that is the next document's BOS is not scored.
- Order: grain's `MapDataset`, shuffled by seed and reshuffled every epoch; several sources
  are interleaved by weight (`mixed_batches`). Global batch b is items [b·B, (b+1)·B) of that
  order and each process reads its rows of it, so the batches do not depend on the process
  count. The iterator's state (`get_state()`: the next batch's index, the same in every
  process) is saved with every checkpoint, so a run resumed with any number of processes reads
  exactly the batches an uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.errors import DataError


class Windows:
    """Random-access source: window i is tokens[i·T : i·T + T + 1] (neighbours share a token)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], np.int32)


def train_batches(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                  process_index: int = 0, process_count: int = 1) -> grain.DatasetIterator:
    """Endless shuffled batches (int32); the iterator's `get_state()` / `set_state()` is its
    checkpoint. Each of `process_count` processes reads only its own `batch_size /
    process_count` rows `[rows, seq_len + 1]` of every global batch (every process_count-th
    window of the shuffled order)."""
    return shuffled_batches(_enough_windows(tokens, seq_len, batch_size), batch_size, seed,
                            process_index, process_count)


def _enough_windows(tokens: np.ndarray, seq_len: int, at_least: int) -> Windows:
    windows = Windows(tokens, seq_len)
    if len(windows) < at_least:
        raise DataError(f"the training split has {len(tokens)} tokens: fewer than "
                        f"{'one batch of ' * (at_least > 1)}{at_least} sequence"
                        f"{'s' * (at_least > 1)} of {seq_len} tokens")
    return windows


def shuffled_batches(source, batch_size: int, seed: int, process_index: int = 0,
                     process_count: int = 1) -> grain.DatasetIterator:
    """Endless batches of a random-access source (`len`, `[i]`: packed windows, or a task's
    padded examples), shuffled by seed and reshuffled every epoch; each of `process_count`
    processes reads only its `batch_size / process_count` rows of every global batch."""
    return _batched(_endless(source, seed), batch_size, process_index, process_count)


def mixed_batches(sources: list[tuple[np.ndarray, float]], seq_len: int, batch_size: int,
                  seed: int, process_index: int = 0, process_count: int = 1
                  ) -> grain.DatasetIterator:
    """Endless batches of packed windows drawn from several token arrays in proportion to
    their weights: grain's `MapDataset.mix` interleaves the sources' shuffled windows so that
    every stretch of sequences holds each source's share (to within one sequence), the same
    for any seed and process count. Source i is shuffled with a seed of its own."""
    datasets = []
    for i, (tokens, _) in enumerate(sources):
        windows = _enough_windows(tokens, seq_len, 1)
        own_seed = int(np.random.SeedSequence([seed, i]).generate_state(1)[0])
        datasets.append(_endless(windows, own_seed))
    weights = [w for _, w in sources]
    return _batched(grain.MapDataset.mix(datasets, weights), batch_size, process_index,
                    process_count)


def _endless(source, seed: int) -> grain.MapDataset:
    """`source` shuffled by `seed`, reshuffled every epoch, endless in practice (2^62 items)
    but of finite length: grain's `batch` overflows computing the length of an infinite
    dataset in batches of one row."""
    epochs = sys.maxsize // 2 // len(source)
    return grain.MapDataset.source(source).shuffle(seed=seed).repeat(epochs)


def _batched(dataset: grain.MapDataset, batch_size: int, process_index: int,
             process_count: int) -> grain.DatasetIterator:
    """This process's rows of each global batch: global batch b is items [b·B, (b+1)·B), and
    process p takes every process_count-th of them from the p-th. Its iterator's state (the
    next batch's index) is the same in every process and for any process count."""
    if process_count > 1:
        dataset = dataset[process_index::process_count]
    return iter(dataset.batch(batch_size // process_count).to_iter_dataset())


def val_batches(tokens: np.ndarray, seq_len: int, batch_size: int, limit: int,
                process_index: int = 0, process_count: int = 1) -> list[np.ndarray]:
    """The first `limit` validation batches in corpus order (the same ones at every eval);
    this process's rows of each."""
    windows = Windows(tokens, seq_len)
    n = min(limit, len(windows) // batch_size)
    if n == 0:
        raise DataError(f"the validation split has {len(tokens)} tokens: fewer than one batch "
                        f"of {batch_size} sequences of {seq_len} tokens; raise "
                        "data.val_fraction or lower train.batch_size")
    return [np.stack([windows[b * batch_size + i]
                      for i in range(process_index, batch_size, process_count)])
            for b in range(n)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Features:
    inputs_BT: jax.Array
    targets_BT: jax.Array
    positions_BT: jax.Array  # restart at 0 at every BOS (and at the window start)
    segment_ids_BT: jax.Array  # tokens attend only within their segment
    weights_BT: jax.Array  # float32; 0 where the target starts the next document


def features(window_BT1: jax.Array, bos_id: int) -> Features:
    """Model inputs and loss targets of packed windows `[B, T + 1]`."""
    inputs_BT, targets_BT = window_BT1[:, :-1], window_BT1[:, 1:]
    is_bos_BT = inputs_BT == bos_id
    index_T = jnp.arange(inputs_BT.shape[1], dtype=jnp.int32)
    start_BT = jax.lax.cummax(jnp.where(is_bos_BT, index_T, 0), axis=1)
    return Features(inputs_BT=inputs_BT, targets_BT=targets_BT,
                    positions_BT=index_T - start_BT,
                    segment_ids_BT=jnp.cumsum(is_bos_BT, axis=1, dtype=jnp.int32),
                    weights_BT=(targets_BT != bos_id).astype(jnp.float32))
