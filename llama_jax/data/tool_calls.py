"""Tool calls: how a chat model is told about functions, how it writes a call, and how calls are
read back out of its text, as it is written.

    form = tool_format(template)            # the checkpoint's chat template decides
    messages, extra = tool_prompt(form, messages, tools)
    reader = ToolCallReader(form)
    for piece in generated_text:
        for delta in reader.push(piece): ...  # content text, a call's name, its arguments' text
    reader.finish()

A call is `{"name": ..., "arguments": {...}}` (`"parameters"` in LLaMA 3.1's format), written as
its format writes calls:
- `hermes` (Hermes, Qwen 2.5 and 3, and every template that writes `<tool_call>`): one call
  per `<tool_call>\\n{...}\\n</tool_call>` block, text allowed around the blocks;
- `llama3_json` (LLaMA 3.1 and 3.2's templates, which write `"parameters"`): the whole answer
  is the calls, separated by "; ";
- `builtin`, for a template that does not render tools (SmolLM2's) and for Meta's formats:
  the tools in a system message we write, and the calls as SmolLM2's function-calling data
  writes them, a JSON list in `<tool_call>[...]</tool_call>`; `tool` messages go back to the
  model as user turns in `<tool_response>` tags, and an assistant's calls as its text.

decode/grammar.py's `call_grammar` constrains an answer to calls in a format.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Sequence

PYTHON_TAG = "<|python_tag|>"  # LLaMA 3.1 may open a call with it


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """How one family of chat templates writes tool calls (see the module doc)."""

    name: str
    open: str  # the text before a block of calls ("": the answer is the calls)
    close: str  # the text after it
    arguments: str  # the key of a call's arguments
    listed: bool  # a block holds a JSON list of calls, not one call
    template_renders_tools: bool  # the template writes the tools and calls itself

    def call_text(self, calls: Sequence[dict]) -> str:
        """The text of `calls` ({"name", "arguments": dict}) as this format writes them."""
        objects = [{"name": c["name"], self.arguments: c["arguments"]} for c in calls]
        if self.listed:
            return f"{self.open}{json.dumps(objects, ensure_ascii=False)}{self.close}"
        if not self.open:
            return "; ".join(json.dumps(o, ensure_ascii=False) for o in objects)
        return "\n".join(f"{self.open}\n{json.dumps(o, ensure_ascii=False)}\n{self.close}"
                         for o in objects)


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", False, True)
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "parameters", False, True)
BUILTIN = ToolFormat("builtin", "<tool_call>", "</tool_call>", "arguments", True, False)


def tool_format(template_text: str | None) -> ToolFormat:
    """The tool-call format of a chat template's text (None: no template)."""
    if template_text is None or "tools" not in template_text:
        return BUILTIN
    if "<tool_call>" in template_text:
        return HERMES
    if '"parameters"' in template_text:
        return LLAMA3_JSON
    return BUILTIN  # it names tools, but in a way we cannot read the calls of


# ----------------------------------------------------------------------------- prompts

_BUILTIN_INSTRUCTIONS = """\
You may call functions to answer. The functions, each with a JSON Schema of its arguments:
<tools>
{tools}
</tools>
To call functions, answer with nothing but a JSON list of the calls between <tool_call> and \
</tool_call>, each call an object with the function's "name" and its "arguments":
<tool_call>[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]</tool_call>
The results come back between <tool_response> and </tool_response>. To answer without a call, \
write plain text."""


def tool_prompt(form: ToolFormat, messages: Sequence[dict], tools: Sequence[dict] | None
                ) -> tuple[list[dict], dict]:
    """The messages to render and the template's extra variables for a conversation with
    `tools` (OpenAI's `[{"type": "function", "function": {...}}]`, or None) and tool messages
    (an assistant's `tool_calls` with dict arguments, `tool` results)."""
    if form.template_renders_tools:
        return list(messages), ({"tools": list(tools)} if tools else {})
    plain = []
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if plain and plain[-1].get("tool_responses"):  # parallel calls' results: one turn
                plain[-1] = {**plain[-1], "content": f"{plain[-1]['content']}\n{response}"}
            else:
                plain.append({"role": "user", "content": response, "tool_responses": True})
        elif message.get("tool_calls"):
            calls = [call["function"] for call in message["tool_calls"]]
            plain.append({"role": "assistant",
                          "content": (message.get("content") or "") + form.call_text(calls)})
        else:
            plain.append(message)
    plain = [{"role": m["role"], "content": m["content"]} for m in plain]
    if tools:
        described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        system = _BUILTIN_INSTRUCTIONS.format(tools=described)
        if plain and plain[0]["role"] == "system":
            system = f"{plain[0]['content']}\n\n{system}"
            plain = plain[1:]
        plain = [{"role": "system", "content": system}, *plain]
    return plain, {}


# ----------------------------------------------------------------------------- reading

@dataclasses.dataclass(frozen=True)
class Delta:
    """A piece of an answer: `content` text; or, for call `index`, its start (`id`, `name`)
    or more of its `arguments`' JSON text."""

    content: str = ""
    index: int = -1
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCallReader:
    """Reads an answer's text, piece by piece, into content and calls. A call is given out as
    soon as its name is read, and its arguments as they are written; text that may still
    begin a call (a block's opening, a call's `{"name": ...`) is held until it is known.
    Whitespace between calls, or after them, is not content. Text that turns out not to be a
    call (not JSON of a call) is content."""

    def __init__(self, form: ToolFormat):
        self.form = form
        self.calls = 0
        self._text = ""  # read, not yet given out
        self._state = "outside" if form.open else "start"
        self._block_calls = 0  # calls read in the current block
        self._blank = ""  # whitespace content, given out once content follows it
        self._before_block = ""  # the whitespace before the current block's opening
        self._json: _JsonEnd | None = None

    def push(self, text: str) -> list[Delta]:
        self._text += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        """What is left once the answer is complete."""
        out: list[Delta] = []
        if self._state in ("outside", "plain", "raw", "start") or (
                self._state == "head" and self._text.strip()):
            opened = self._reopened() if self._state == "head" else ""
            self._content(opened + self._text, out)
        if not self.calls and self._blank:
            out.append(Delta(content=self._blank))
        self._text, self._blank = "", ""
        return out

    def _reopened(self) -> str:
        """The opening of a block found to hold no call, given back as text (with the
        whitespace before it); nothing once the block held a call."""
        if self._block_calls or not self.form.open:
            return ""
        self._blank = self._before_block
        return self.form.open

    def _step(self, out: list[Delta]) -> bool:
        """Reads what it can of the held text in the current state; False when it needs more."""
        return getattr(self, f"_{self._state}")(out)

    def _start(self, out: list[Delta]) -> bool:  # a format whose answer is the calls
        text = self._text.lstrip()
        if not text or PYTHON_TAG.startswith(text):
            return False
        if text.startswith(PYTHON_TAG):
            self._text = text[len(PYTHON_TAG):]
            return True
        self._state = "head" if text.startswith("{") else "plain"
        return True

    def _plain(self, out: list[Delta]) -> bool:  # an answer that is not calls
        self._content(self._text, out)
        self._text = ""
        return False

    def _content_until(self, marker: str, out: list[Delta]) -> int:
        """Where `marker` is in the held text; -1 while it is not, the text that cannot begin
        it given out as content."""
        at = self._text.find(marker)
        if at < 0:
            cut = len(self._text) - _longest_prefix_end(self._text, marker)
            self._content(self._text[:cut], out)
            self._text = self._text[cut:]
        return at

    def _outside(self, out: list[Delta]) -> bool:
        at = self._content_until(self.form.open, out)
        if at < 0:
            return False
        self._content(self._text[:at], out, before_call=True)
        self._text, self._state, self._block_calls = self._text[at + len(self.form.open):], \
            "head", 0
        return True

    def _head(self, out: list[Delta]) -> bool:
        text = self._text.lstrip(" \t\r\n,;[]" if self.form.listed else " \t\r\n;")
        close = self.form.close
        if close and text.startswith(close):
            self._text, self._state = text[len(close):], "outside"
            return True
        if not text or close and close.startswith(text):
            return False
        found, name, end = _call_head(text)
        if found is None:
            return False
        if not found:  # not a call: the rest of the block is text
            self._text, self._state = self._reopened() + self._text, "raw" if close else "plain"
            return True
        out.append(Delta(index=self.calls, id=f"call_{uuid.uuid4().hex[:24]}", name=name))
        self._text, self._state, self._json = text[end:], "arguments", _JsonEnd()
        return True

    def _arguments(self, out: list[Delta]) -> bool:
        skip, end, done = self._json.read(self._text)
        if end > skip:
            out.append(Delta(index=self.calls, arguments=self._text[skip:end]))
        self._text = self._text[end:]
        if done:  # the rest of the call's object, to its closing brace
            self._state, self._json = "tail", _JsonEnd(depth=1)
            self.calls, self._block_calls = self.calls + 1, self._block_calls + 1
        return done

    def _tail(self, out: list[Delta]) -> bool:
        _, end, done = self._json.read(self._text)
        self._text = self._text[end:]
        if done:
            self._state = "head"
        return done

    def _raw(self, out: list[Delta]) -> bool:  # a block that holds no call, up to its end
        at = self._content_until(self.form.close, out)
        if at < 0:
            return False
        end = at + len(self.form.close)
        self._content(self._text[:end], out)
        self._text, self._state = self._text[end:], "outside"
        return True

    def _content(self, text: str, out: list[Delta], before_call: bool = False) -> None:
        """Gives out content text but its trailing whitespace, which waits for what follows:
        more content (given out with it), a call or the end of the calls (dropped)."""
        text = self._blank + text
        kept = text.rstrip()
        self._blank = "" if before_call else text[len(kept):]
        if before_call:  # given back if the block holds no call
            self._before_block = text[len(kept):]
        if kept:
            out.append(Delta(content=kept))


def _longest_prefix_end(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    return max((n for n in range(min(len(marker) - 1, len(text)), 0, -1)
                if text.endswith(marker[:n])), default=0)


def _call_head(text: str) -> tuple[bool | None, str | None, int]:
    """Whether `text` begins a call, `{"name": "...", "arguments": ` (or "parameters"), as
    (True, name, where its arguments begin); (None, ...) while it may still; (False, ...)
    when it cannot."""
    at, name = 0, None
    for piece in ("{", ('"name"',), ":", None, ",", ('"arguments"', '"parameters"'), ":"):
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return None, None, 0
        if piece is None:  # the name: a JSON string
            if text[at] != '"':
                return False, None, 0
            _, end, done = _JsonEnd().read(text[at:])
            if not done:
                return None, None, 0
            try:
                name = json.loads(text[at:at + end])
            except json.JSONDecodeError:  # a bad escape
                return False, None, 0
            at += end
            continue
        options = piece if isinstance(piece, tuple) else (piece,)
        rest = text[at:]
        if not any(o.startswith(rest[:len(o)]) for o in options):
            return False, None, 0
        matched = [o for o in options if rest.startswith(o)]
        if not matched:
            return None, None, 0
        at += len(matched[0])
    return True, name, at


class _JsonEnd:
    """Finds where a JSON value ends in text read piece by piece (strings, nesting; a scalar
    ends at the next `,`, `}`, `]` or space). `depth=1`: inside an object already, to its
    closing brace."""

    def __init__(self, depth: int = 0):
        self.depth, self.started = depth, depth > 0
        self.string = self.escape = False

    def read(self, text: str) -> tuple[int, int, bool]:
        """(skip, end, done): text[skip:end] belongs to the value (leading spaces skipped);
        done when the value ended at `end`."""
        at = 0
        if not self.started:
            while at < len(text) and text[at].isspace():
                at += 1
            if at == len(text):
                return at, at, False
            self.started = True
        skip = at
        for i in range(at, len(text)):
            c = text[i]
            if self.string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.string = False
                    if self.depth == 0:
                        return skip, i + 1, True
            elif c == '"':
                self.string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return skip, i + (self.depth == 0), True
            elif self.depth == 0 and (c == "," or c.isspace()):
                return skip, i, True
        return skip, len(text), False


def joined(deltas: Sequence[Delta]) -> tuple[str | None, list[dict]]:
    """An answer's content (None when it has only calls) and OpenAI `tool_calls` from its
    deltas."""
    content = "".join(d.content for d in deltas)
    calls: list[dict] = []
    for d in deltas:
        if d.id is not None:
            calls.append({"id": d.id, "type": "function",
                          "function": {"name": d.name, "arguments": ""}})
        elif d.arguments:
            calls[d.index]["function"]["arguments"] += d.arguments
    return (content or None) if calls else content, calls
