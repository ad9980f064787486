"""Rows of conversations for training: encoded conversations (a JSONL file's, in memory, or a
prepared chat dataset's, memory-mapped) → rows of `train.seq_len` inputs, each built when it is
read → grain's shuffled batches and the validation batches.

A conversation of n tokens takes n - 1 positions of a row: its inputs predict its next tokens;
one longer than a row is cut to it (`task.truncate`) or refused. Packed (`task.packing`),
conversations follow each other in a row in their order, one that does not fit the row's rest
starting the next row, so a row is a run of consecutive conversations and the plan of all rows
(`row_plan`) is one array of conversation indices, computed from the lengths alone. Each
conversation in a row has a segment id of its own (attention never crosses conversations) and
positions from 0; the rest of a row is padding (segment 0, unscored). Unpacked, each row holds
one conversation. Nothing is materialized beyond the batch being read, so a dataset far larger
than memory trains as a small one does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import grain
import numpy as np

from llama_jax.data import shards
from llama_jax.data.batches import shuffled_batches
from llama_jax.data.chat_template import ChatTemplate
from llama_jax.data.conversations import Conversation, read_conversations, split
from llama_jax.data.tokenizer import Tokenizer, tokenizer_sha256
from llama_jax.errors import DataError

# A row's arrays, named as the language model's inputs (data/batches.py's Features)
ROW_FIELDS = {"inputs_BT": np.int32, "targets_BT": np.int32, "weights_BT": np.float32,
              "positions_BT": np.int32, "segment_ids_BT": np.int32}


@dataclasses.dataclass(frozen=True)
class ConversationSet:
    """Encoded conversations laid end to end: conversation c is `tokens[starts[c]:starts[c +
    1]]`, `assistant` beside its tokens (1 where the token is the assistant's). The two may be
    memory maps (shards.ShardedTokens)."""

    tokens: Any  # [N]
    assistant: Any  # [N]
    starts: np.ndarray  # int64 [C + 1]
    where: str  # what holds them, for messages

    @classmethod
    def of(cls, conversations: Sequence[Conversation], where: str) -> ConversationSet:
        lengths = [len(c.tokens) for c in conversations]
        starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        return cls(np.concatenate([c.tokens for c in conversations]),
                   np.concatenate([c.assistant for c in conversations]).astype(np.uint8),
                   starts, where)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)


def row_plan(lengths: np.ndarray, seq_len: int, packing: bool) -> np.ndarray:
    """The first conversation of each row, then the number of conversations (`[R + 1]`): row r
    holds conversations plan[r]..plan[r + 1] - 1 (see the module doc). Conversations longer
    than a row count as cut to it."""
    positions = (np.minimum(lengths, seq_len + 1) - 1).tolist()
    firsts, used = [], 0
    for c, n in enumerate(positions):
        if n < 1:  # a lone token predicts nothing
            continue
        if not firsts or not packing or used + n > seq_len:
            firsts.append(c)
            used = 0
        used += n
    return np.asarray(firsts + [len(positions)], np.int64)


class Rows:
    """The rows of a ConversationSet (`ROW_FIELDS` arrays `[T]` each), built when read:
    random access for grain's MapDataset."""

    def __init__(self, conversations: ConversationSet, seq_len: int, packing: bool,
                 pad_id: int):
        self.conversations, self.seq_len, self.pad_id = conversations, seq_len, pad_id
        self.plan = row_plan(conversations.lengths(), seq_len, packing)

    def __len__(self) -> int:
        return len(self.plan) - 1

    def __getitem__(self, r: int) -> dict[str, np.ndarray]:
        """Row r: its conversations' inputs, targets, weights (1 where the target is the
        assistant's), positions and segment ids; padding after them."""
        T, starts = self.seq_len, self.conversations.starts
        first, end = int(self.plan[r]), int(self.plan[r + 1])
        span = slice(int(starts[first]), int(starts[end]))  # read once: shards are mapped
        tokens = np.asarray(self.conversations.tokens[span], np.int32)
        mine = np.asarray(self.conversations.assistant[span], np.float32)
        row = {name: np.zeros(T, dtype) for name, dtype in ROW_FIELDS.items()}
        row["inputs_BT"][:] = row["targets_BT"][:] = self.pad_id
        at, segment = 0, 0
        for c in range(first, end):
            begin = int(starts[c] - starts[first])
            n = min(int(starts[c + 1] - starts[c]), T + 1) - 1
            if n < 1:
                continue
            segment += 1
            into, ids = slice(at, at + n), tokens[begin:begin + n + 1]
            row["inputs_BT"][into], row["targets_BT"][into] = ids[:-1], ids[1:]
            row["weights_BT"][into] = mine[begin + 1:begin + n + 1]
            row["positions_BT"][into] = np.arange(n)
            row["segment_ids_BT"][into] = segment
            at += n
        return row


def pack(conversations: Sequence[Conversation], seq_len: int, packing: bool, pad_id: int
         ) -> dict[str, np.ndarray]:
    """Every row of these conversations, stacked: `ROW_FIELDS` arrays `[R, T = seq_len]`."""
    rows = Rows(ConversationSet.of(conversations, "conversations"), seq_len, packing, pad_id)
    built = [rows[r] for r in range(len(rows))]
    return {name: np.stack([row[name] for row in built]) for name in ROW_FIELDS}


@dataclasses.dataclass(frozen=True)
class ChatSplits:
    """A chat run's training and validation conversations, and where each came from."""

    train: ConversationSet
    val: ConversationSet
    val_source: str

    def truncated(self, seq_len: int) -> int:
        """Conversations longer than a row (cut to it)."""
        return sum(int(np.sum(s.lengths() > seq_len + 1)) for s in (self.train, self.val))


def chat_splits(train: str, val: str | None, val_fraction: float, template: ChatTemplate,
                tokenizer: Tokenizer, seq_len: int, truncate: bool) -> ChatSplits:
    """The conversations of `task.train` (a JSONL file, or a prepared chat dataset: its train
    split) and of validation: `task.val` (a JSONL file, or every conversation of a prepared
    dataset), else held out of the training file by `val_fraction`, or a prepared dataset's
    val split. Conversations longer than `seq_len` + 1 tokens are refused without
    `truncate`."""
    def read(path: str, splits: tuple[str, ...]) -> ConversationSet:
        if shards.is_prepared(path):
            return _conversations(_opened(path, template, tokenizer), splits, seq_len,
                                  truncate)
        return ConversationSet.of(read_conversations(path, template, tokenizer, seq_len,
                                                     truncate), path)

    if val is not None:
        return ChatSplits(read(train, ("train",)), read(val, shards.SPLITS), val)
    if shards.is_prepared(train):  # opened and checked once for both splits
        prepared = _opened(train, template, tokenizer)
        return ChatSplits(*(_conversations(prepared, (name,), seq_len, truncate)
                            for name in shards.SPLITS), f"the val split of {train}")
    train_chats, val_chats = split(read_conversations(train, template, tokenizer, seq_len,
                                                      truncate), val_fraction)
    return ChatSplits(ConversationSet.of(train_chats, train),
                      ConversationSet.of(val_chats, train), f"held out of {train}")


def _opened(path: str, template: ChatTemplate, tokenizer: Tokenizer) -> shards.PreparedData:
    """A prepared chat dataset, checked against the run: encoded by this tokenizer and
    template."""
    prepared = shards.open_prepared(path, "chat")
    meta = prepared.meta
    for what, theirs, ours in (
            ("tokenizer", meta["tokenizer_sha256"], tokenizer_sha256(tokenizer)),
            ("chat template", meta["chat_template_sha256"], template.sha256())):
        if theirs != ours:
            raise DataError(f"{path}: prepared with another {what} than the run's (the "
                            "init_from checkpoint's); prepare it again with --chat set to "
                            "that checkpoint")
    return prepared


def _conversations(prepared: shards.PreparedData, splits: tuple[str, ...], seq_len: int,
                   truncate: bool) -> ConversationSet:
    """Splits of a prepared chat dataset: at least one conversation, none too long for a row
    unless `truncate`."""
    tokens, assistant, starts = shards.conversation_arrays(prepared, splits)
    found = ConversationSet(tokens, assistant, starts,
                            f"{prepared.root} ({'+'.join(splits)})")
    if not len(found):
        raise DataError(f"{found.where}: no conversations (prepare with --val-fraction > 0, "
                        "or set task.val)")
    lengths = found.lengths()
    if lengths.max() > seq_len + 1 and not truncate:
        c = int(np.argmax(lengths))
        raise DataError(f"{found.where}: conversation {c} has {int(lengths[c])} tokens, more "
                        f"than train.seq_len + 1 = {seq_len + 1}; raise train.seq_len or set "
                        "task.truncate: true")
    return found


def train_batches(rows: Rows, batch_size: int, seed: int, process_index: int = 0,
                  process_count: int = 1) -> grain.DatasetIterator:
    """Endless shuffled batches of rows, reshuffled every epoch; this process's rows of each
    (as data.batches.train_batches)."""
    if len(rows) < batch_size:
        raise DataError(f"the training conversations fill {len(rows)} rows: fewer than one "
                        f"batch of {batch_size}; lower train.batch_size")
    return shuffled_batches(rows, batch_size, seed, process_index, process_count)


class ValBatches:
    """Every validation row once, in order, as batches built when read; the last batch filled
    with rows of padding (nothing scored); this process's rows of each batch."""

    def __init__(self, rows: Rows, batch_size: int, process_index: int = 0,
                 process_count: int = 1):
        self.rows, self.batch_size = rows, batch_size
        self.mine = range(process_index, batch_size, process_count)

    def __len__(self) -> int:
        return -(-len(self.rows) // self.batch_size)

    def __getitem__(self, b: int) -> dict[str, np.ndarray]:
        if not 0 <= b < len(self):
            raise IndexError(b)
        indices = [b * self.batch_size + i for i in self.mine]
        built = [self.rows[r] if r < len(self.rows) else self._padding() for r in indices]
        return {name: np.stack([row[name] for row in built]) for name in ROW_FIELDS}

    def _padding(self) -> dict[str, np.ndarray]:
        return {name: np.zeros(self.rows.seq_len, dtype) for name, dtype in ROW_FIELDS.items()}
