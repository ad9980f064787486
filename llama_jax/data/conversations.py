"""Conversations for supervised fine-tuning: OpenAI-shaped chats in JSONL → token ids with the
assistant's tokens marked.

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

Conversations come from a JSONL file read whole (`read_conversations`) or, at scale, from a
dataset `python -m llama_jax.data.prepare --chat` wrote (`chat_documents`: what its workers
encode). Validation held out of a training file (`split`) is chosen by each conversation's
`id`, else its messages (`chat_key`), never by where it sits; so is a prepared dataset's.
Rows and batches: chat_rows.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from llama_jax.data.chat import encode_with_special_tokens
from llama_jax.data.chat_template import ChatTemplate, load_chat_template
from llama_jax.data.documents import (BadInput, held_out_keys, jsonl_lines, jsonl_records,
                                      record_key)
from llama_jax.data.tokenizer import Tokenizer
from llama_jax.errors import DataError, GenerateError

ROLES = ("system", "user", "assistant", "tool")


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
    key: str = ""  # what decides its split (`chat_key`)


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


def chat_key(record: dict) -> str:
    """A conversation's split key (documents.record_key): its `id`, else its messages."""
    return record_key(record.get("id"), json.dumps(record["messages"], sort_keys=True))


def read_conversations(path: str | Path, template: ChatTemplate, tokenizer: Tokenizer,
                       seq_len: int, truncate: bool) -> list[Conversation]:
    """Every conversation of a JSONL file, encoded whole; one longer than `seq_len` + 1 tokens
    (a row's inputs and its last target) is refused without `truncate` (rows cut it,
    chat_rows.py). Bad lines are a DataError naming the file and line."""
    conversations = []
    for where, record in jsonl_records(path, "chat"):
        messages, tools = check_messages(record, where)
        try:
            conversation = encode(template, tokenizer, messages, tools)
        except GenerateError as e:
            raise DataError(f"{where}: {e}") from None
        n = len(conversation.tokens)
        if n > seq_len + 1 and not truncate:
            raise DataError(f"{where}: {n} tokens, more than train.seq_len + 1 = "
                            f"{seq_len + 1}; shorten it, raise train.seq_len or set "
                            "task.truncate: true")
        conversations.append(dataclasses.replace(conversation, key=chat_key(record)))
    if not conversations:
        raise DataError(f"chat file {path}: no conversations")
    return conversations


def chat_documents(unit: dict, template: ChatTemplate, tokenizer: Tokenizer
                   ) -> Iterator[tuple[str, Conversation | BadInput]]:
    """(split key, the encoded conversation) per line of a unit's JSONL files, or (the line's
    name, a BadInput `bad_chat`, `not_json` or `not_utf8`): what a chat prepare writes."""
    for entry in unit["files"]:
        for where, line_no, record in jsonl_lines(Path(entry["path"]), entry["name"]):
            if isinstance(record, BadInput):
                yield where, record
                continue
            line = f"{entry['path']}: line {line_no}"  # as the other bad lines are named
            try:
                messages, tools = check_messages(record, line)
                yield chat_key(record), encode(template, tokenizer, messages, tools)
            except DataError as e:
                yield where, BadInput("bad_chat", str(e))
            except GenerateError as e:
                yield where, BadInput("bad_chat", f"{line}: {e}")


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
