"""Conversations for supervised fine-tuning: OpenAI-shaped chats in JSONL → token ids with the
assistant's tokens marked → packed rows of training inputs.

Each line is `{"messages": [{"role", "content"}, ...]}` (roles system, user, assistant,
tool; a `tools` key is passed to the template, which may take it). A conversation is rendered
whole by the checkpoint's own chat template (`ChatTemplate`, no generation prompt) and cut into
pieces, each the assistant's or not (`pieces`):
- where the template marks the assistant's text (`{% generation %}` blocks), by the marks;
- otherwise each assistant turn i is what rendering turns 0..i adds to rendering turns 0..i-1
  with the generation prompt: the turn's content and its end-of-turn text, not its header. A
  template that does not render a conversation's earlier turns as a prefix of it is refused
  (naming the line), since no span could be trusted.
Each piece is encoded on its own (control tokens named in the text become those tokens, as
`chat.encode_with_special_tokens` does), so a piece's tokens are exactly the piece's: the
loss counts a target token iff it is in an assistant piece.

Rows (`pack`) hold `train.seq_len` inputs. Packed (`packing`), conversations follow each other
in a row in file order, a conversation that does not fit the row's rest starting the next row;
each has a segment id of its own (attention never crosses conversations) and positions from
0; the rest of a row is padding (segment 0, unscored). Unpacked, each row holds one. A
conversation longer than a row is refused (`truncate: false`, naming the line) or cut to it.
Validation held out of the training file (`split`) is chosen by each conversation's `id`,
else its messages, never by where it sits; batches are grain's, as pretraining's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import grain
import numpy as np

from llama_jax.data.batches import shuffled_batches
from llama_jax.data.chat import encode_with_special_tokens
from llama_jax.data.chat_template import ChatTemplate, load_chat_template
from llama_jax.data.documents import held_out_keys, jsonl_records, record_key
from llama_jax.data.tokenizer import Tokenizer
from llama_jax.errors import DataError, GenerateError

ROLES = ("system", "user", "assistant", "tool")
# A packed row's arrays, named as the language model's inputs (data/batches.py's Features)
ROW_FIELDS = {"inputs_BT": np.int32, "targets_BT": np.int32, "weights_BT": np.float32,
              "positions_BT": np.int32, "segment_ids_BT": np.int32}


# The format a checkpoint without a chat template is fine-tuned in (as TRL's
# `setup_chat_format` does): ChatML
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chat_template_for(checkpoints: Sequence[str | Path]) -> ChatTemplate:
    """The first of these checkpoints' own chat templates, else ChatML (no checkpoint, or
    none with one)."""
    found = (load_chat_template(c) for c in checkpoints)
    return next((t for t in found if t is not None),
                ChatTemplate("ChatML (the checkpoint has no chat template)", CHATML))


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One conversation's token ids and, per token, whether it is the assistant's."""

    tokens: np.ndarray  # int32 [n]
    assistant: np.ndarray  # bool [n]
    key: str = ""  # what decides its split (documents.record_key): its id, else its messages
    truncated: bool = False


def check_messages(record: Any, where: str) -> tuple[list[dict], Any]:
    """A line's messages (and its tools, or None), or a DataError naming the line and what is
    wrong: no messages, a message that is not {role, content}, an unknown role, no assistant
    turn."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) \
            or not record["messages"]:
        raise DataError(f"{where}: no \"messages\" list (a line is {{\"messages\": "
                        "[{\"role\": ..., \"content\": ...}, ...]})")
    for i, message in enumerate(record["messages"]):
        if not isinstance(message, dict) or "role" not in message:
            raise DataError(f"{where}: messages[{i}] is not a {{\"role\", \"content\"}} object")
        if message["role"] not in ROLES:
            raise DataError(f"{where}: messages[{i}]: unknown role {message['role']!r} (one of "
                            f"{', '.join(ROLES)})")
        if not isinstance(message.get("content", ""), str):
            raise DataError(f"{where}: messages[{i}]: content must be a string")
    if not any(m["role"] == "assistant" for m in record["messages"]):
        raise DataError(f"{where}: no assistant turn: nothing to train on")
    return record["messages"], record.get("tools")


def pieces(template: ChatTemplate, messages: Sequence[dict], tools: Any = None
           ) -> list[tuple[str, bool]]:
    """The conversation's rendered text in pieces, each with whether it is the assistant's
    (see the module doc); a GenerateError when the template fails or renders turns so that
    the spans cannot be found."""
    extra = {} if tools is None else {"tools": tools}
    if template.marks_generation:
        return template.render_generation(messages, **extra)
    whole = template.render(messages, add_generation_prompt=False, **extra)
    out, done = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True, **extra)
        through = template.render(messages[:i + 1], add_generation_prompt=False, **extra)
        if not (through.startswith(before) and whole.startswith(through)
                and len(before) >= done):
            raise GenerateError(f"{template.source}: the chat template does not render the "
                                f"conversation up to its assistant turn {i} as the start of "
                                "the whole (no span of the assistant's tokens can be found)")
        out += [(whole[done:len(before)], False), (whole[len(before):len(through)], True)]
        done = len(through)
    out.append((whole[done:], False))
    return [(piece, mine) for piece, mine in out if piece]


def encode(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[dict],
           tools: Any = None) -> Conversation:
    """The conversation's tokens and which are the assistant's."""
    ids, mine = [], []
    for piece, assistant in pieces(template, messages, tools):
        piece_ids = encode_with_special_tokens(tokenizer, piece)
        ids += piece_ids
        mine += [assistant] * len(piece_ids)
    return Conversation(np.asarray(ids, np.int32), np.asarray(mine, bool))


def read_conversations(path: str | Path, template: ChatTemplate, tokenizer: Tokenizer,
                       seq_len: int, truncate: bool) -> list[Conversation]:
    """Every conversation of a JSONL file, encoded; one longer than `seq_len` + 1 tokens (a
    row's inputs and its last target) cut to it, or refused without `truncate`. Bad lines are
    a DataError naming the file and line."""
    conversations = []
    for where, record in jsonl_records(path, "chat"):
        messages, tools = check_messages(record, where)
        try:
            conversation = encode(template, tokenizer, messages, tools)
        except GenerateError as e:
            raise DataError(f"{where}: {e}") from None
        key = record_key(record.get("id"), json.dumps(record["messages"], sort_keys=True))
        n = len(conversation.tokens)
        if n > seq_len + 1 and not truncate:
            raise DataError(f"{where}: {n} tokens, more than train.seq_len + 1 = "
                            f"{seq_len + 1}; shorten it, raise train.seq_len or set "
                            "task.truncate: true")
        conversations.append(Conversation(conversation.tokens[:seq_len + 1],
                                          conversation.assistant[:seq_len + 1], key,
                                          truncated=n > seq_len + 1))
    if not conversations:
        raise DataError(f"chat file {path}: no conversations")
    return conversations


def pack(conversations: Sequence[Conversation], seq_len: int, packing: bool, pad_id: int
         ) -> dict[str, np.ndarray]:
    """Rows `[R, T = seq_len]` of language-model inputs (`ROW_FIELDS`): inputs, targets,
    weights (float32: 1 where the target is the assistant's), positions and segment ids (see
    the module doc). A conversation of n tokens takes n - 1 positions: its inputs predict its
    next tokens."""
    rows, row, used = [], [], 0
    for conversation in conversations:
        n = len(conversation.tokens) - 1
        if n < 1:
            continue
        if n > seq_len:
            raise DataError(f"a conversation of {n + 1} tokens does not fit a row of "
                            f"{seq_len} inputs (read_conversations cuts or refuses it)")
        if row and (not packing or used + n > seq_len):
            rows.append(row)
            row, used = [], 0
        row.append(conversation)
        used += n
    if row:
        rows.append(row)
    out = {name: np.zeros((len(rows), seq_len), dtype) for name, dtype in ROW_FIELDS.items()}
    out["inputs_BT"][:] = out["targets_BT"][:] = pad_id
    for r, members in enumerate(rows):
        at = 0
        for segment, c in enumerate(members, 1):
            n = len(c.tokens) - 1
            span = slice(at, at + n)
            out["inputs_BT"][r, span], out["targets_BT"][r, span] = c.tokens[:-1], c.tokens[1:]
            out["weights_BT"][r, span] = c.assistant[1:]
            out["positions_BT"][r, span] = np.arange(n)
            out["segment_ids_BT"][r, span] = segment
            at += n
    return out


def split(conversations: list[Conversation], val_fraction: float
          ) -> tuple[list[Conversation], list[Conversation]]:
    """(training, validation) conversations: those whose key hashes below `val_fraction`
    held out, at least one each way (`documents.held_out_keys`)."""
    held_out = held_out_keys((c.key for c in conversations), val_fraction)
    if held_out is None:
        raise DataError(f"{len(conversations)} conversation(s): need at least two to hold one "
                        "out for validation (or give task.val)")
    return ([c for c in conversations if c.key not in held_out],
            [c for c in conversations if c.key in held_out])


class _Rows:
    """Random-access source of packed rows (grain's MapDataset reads it)."""

    def __init__(self, rows: dict[str, np.ndarray]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows["inputs_BT"])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {name: a[i] for name, a in self.rows.items()}


def train_batches(rows: dict[str, np.ndarray], batch_size: int, seed: int,
                  process_index: int = 0, process_count: int = 1) -> grain.DatasetIterator:
    """Endless shuffled batches of rows, reshuffled every epoch; this process's rows of each
    (as data.batches.train_batches)."""
    if len(rows["inputs_BT"]) < batch_size:
        raise DataError(f"the training conversations fill {len(rows['inputs_BT'])} rows: "
                        f"fewer than one batch of {batch_size}; lower train.batch_size")
    return shuffled_batches(_Rows(rows), batch_size, seed, process_index, process_count)


def val_batches(rows: dict[str, np.ndarray], batch_size: int, process_index: int = 0,
                process_count: int = 1) -> list[dict[str, np.ndarray]]:
    """Every validation row once, in order; the last batch filled with rows of padding
    (nothing scored); this process's rows of each batch."""
    n = len(rows["inputs_BT"])
    fill = -(-n // batch_size) * batch_size - n
    full = {name: np.concatenate([a, np.zeros((fill, *a.shape[1:]), a.dtype)])
            for name, a in rows.items()}
    mine = [b * batch_size + i for b in range(len(full["inputs_BT"]) // batch_size)
            for i in range(process_index, batch_size, process_count)]
    per_batch = batch_size // process_count
    return [{name: a[mine[k:k + per_batch]] for name, a in full.items()}
            for k in range(0, len(mine), per_batch)]
