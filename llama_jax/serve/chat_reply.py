"""A chat choice's answer as OpenAI gives it: its text as `content`, or, when the request has
tools, read for the calls the model made (data/tool_calls.py): `message.tool_calls` (ids, names,
JSON arguments) and `finish_reason: "tool_calls"`; streamed, as `delta.tool_calls`: a call's
index, id, type and name first, then its arguments' text as it is written.

The streamed deltas and the whole message come from the same reader over the same text, so
the deltas join into the message.
"""

from __future__ import annotations

from typing import Sequence

from llama_jax.data.tool_calls import Delta, ToolCallReader, ToolFormat, joined


class ChatReply:
    """One choice's answer (`form`: the tool-call format to read, None: text only)."""

    def __init__(self, form: ToolFormat | None):
        self._reader = None if form is None else ToolCallReader(form)

    def deltas(self, text: str, last: bool) -> list[dict]:
        """OpenAI's deltas for more of the answer's text (`last`: the end of the answer)."""
        if self._reader is None:
            return [{"content": text}] if text else []
        pieces = self._reader.push(text) + (self._reader.finish() if last else [])
        return [_delta(group) for group in _runs(pieces)]

    def message(self, text: str) -> dict:
        """The whole answer's message."""
        if self._reader is None:
            return {"role": "assistant", "content": text}
        content, calls = joined(self._reader.push(text) + self._reader.finish())
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls
                                                             else {})}

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish reason: "tool_calls" where it stopped after making calls."""
        return "tool_calls" if reason == "stop" and self._reader and self._reader.calls else \
            reason


def _runs(pieces: Sequence[Delta]) -> list[list[Delta]]:
    """Pieces grouped into runs that make one delta each: content, or one call's arguments
    (after its start, when it starts here; a call's arguments follow its start)."""
    runs: list[list[Delta]] = []
    for piece in pieces:
        previous = runs[-1][-1] if runs else None
        if previous is not None and piece.id is None and (piece.index < 0) == (
                previous.index < 0):
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return runs


def _delta(run: list[Delta]) -> dict:
    first = run[0]
    if first.index < 0:
        return {"content": "".join(p.content for p in run)}
    call = {"index": first.index, "function": {"arguments": "".join(p.arguments for p in run)}}
    if first.id is not None:
        call = {"index": first.index, "id": first.id, "type": "function",
                "function": {"name": first.name, **call["function"]}}
    return {"tool_calls": [call]}
