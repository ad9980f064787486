"""A checkpoint's own chat template: the Jinja program that turns OpenAI-style `messages` into
the exact prompt text the model was trained on.

    template = load_chat_template("SmolLM2-135M-Instruct.Q4_1.gguf")   # or a checkpoint dir
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

Found where transformers and llama.cpp keep it: `chat_template.jinja` in a checkpoint directory,
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates: `default`,
`tool_use`, ...), or a GGUF file's `tokenizer.chat_template` (`tokenizer.chat_template.NAME`).
Rendered as transformers' `apply_chat_template(..., tokenize=False)` renders it: Jinja2's
immutable sandbox with `trim_blocks` and `lstrip_blocks`, loop controls, the globals
`raise_exception` and `strftime_now`, a `tojson` filter that keeps non-ASCII text, the
checkpoint's `bos_token` / `eos_token`, and `{% generation %}` blocks (which mark the
assistant's tokens for training) rendered as their contents.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Sequence

from llama_jax.data.json_tokenizer import TOKENIZER_CONFIG, read_settings, token_text
from llama_jax.errors import CheckpointError, GenerateError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
GGUF_KEY = "tokenizer.chat_template"


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the tokens it may name; `source` is where it was read."""

    source: str
    text: str
    bos_token: str = ""
    eos_token: str = ""

    def sha256(self) -> str:
        """What the rendered text depends on, hashed: the template and its BOS and EOS."""
        return hashlib.sha256(json.dumps([self.text, self.bos_token, self.eos_token]).encode()
                              ).hexdigest()

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks the assistant's tokens (`{% generation %}` blocks)."""
        return _GENERATION_TAG.search(self.text) is not None

    def render_generation(self, messages: Sequence[dict], **extra: Any
                          ) -> list[tuple[str, bool]]:
        """The whole conversation's text (no generation prompt) cut into pieces, each with
        whether a `{% generation %}` block rendered it (the assistant's tokens to train on)."""
        token = _MARKING.set(True)
        try:
            text = self.render(messages, add_generation_prompt=False, **extra)
        finally:
            _MARKING.reset(token)
        pieces = []
        for i, part in enumerate(text.split(_GENERATION_START)):
            inside, _, after = part.partition(_GENERATION_END) if i else ("", "", part)
            pieces += [(inside, True), (after, False)]
        return [(piece, generated) for piece, generated in pieces if piece]

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text for `messages` (`extra`: more template variables, e.g. `tools`).
        A template that refuses the messages (`raise_exception`) or fails raises
        GenerateError naming the source and the template's own message."""
        template = _compiled(self.text)
        import jinja2

        try:
            return template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except _Refused as e:
            raise GenerateError(f"{self.source}: the chat template refused the messages: "
                                f"{e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
            raise GenerateError(f"{self.source}: the chat template failed: {e}") from None


# While `render_generation` renders, each `{% generation %}` block's output is wrapped in
# these (private-use characters, which no template writes)
_MARKING: contextvars.ContextVar[bool] = contextvars.ContextVar("chat_generation_marks",
                                                                default=False)
_GENERATION_START, _GENERATION_END = "\ue000", "\ue001"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _Refused(Exception):
    """`raise_exception(message)` called by a template."""


def _raise_exception(message: str):
    raise _Refused(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.cache
def _environment():
    try:
        import jinja2
    except ImportError:
        raise CheckpointError("chat templates need jinja2 (pip install 'llama_jax[serve]' "
                              "or 'llama_jax[gguf]')") from None
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: its body, rendered in place (marked
        while `render_generation` renders)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("marked"), [], [], body,
                                          lineno=lineno)

        def marked(self, caller):
            text = caller()
            return f"{_GENERATION_START}{text}{_GENERATION_END}" if _MARKING.get() else text

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compiled(text: str):
    return _environment().from_string(text)


def _checked(template: ChatTemplate) -> ChatTemplate:
    """The template, compiled once so a syntax error is reported while loading."""
    _environment()  # says so first when jinja2 is missing
    import jinja2

    try:
        _compiled(template.text)
    except jinja2.TemplateError as e:
        raise CheckpointError(f"{template.source}: not a valid chat template: {e}") from None
    return template


def load_chat_template(path: str | Path, name: str | None = None) -> ChatTemplate | None:
    """The chat template of a checkpoint directory or GGUF file (`name`: one of several named
    templates, e.g. "tool_use"; default: the one named "default"), None when it has none."""
    from llama_jax import gguf_file as gguf

    path = Path(path)
    if path.is_file() and gguf.is_gguf(path):
        return _from_gguf(path, gguf.metadata(gguf.open_file(path)), name)
    if not path.is_dir():
        raise CheckpointError(f"{path}: neither a checkpoint directory nor a GGUF file")
    settings = read_settings(path / TOKENIZER_CONFIG)
    tokens = {key: token_text(settings.get(key)) or "" for key in ("bos_token", "eos_token")}
    if (path / CHAT_TEMPLATE_FILE).is_file() and name is None:
        return _checked(ChatTemplate(str(path / CHAT_TEMPLATE_FILE),
                                     (path / CHAT_TEMPLATE_FILE).read_text(), **tokens))
    found = settings.get("chat_template")
    if isinstance(found, list):
        by_name = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        wanted = name or "default"
        if wanted not in by_name:
            raise CheckpointError(f"{path / TOKENIZER_CONFIG}: chat_template has no template "
                                  f"named {wanted!r} (it has {', '.join(map(str, by_name))})")
        found = by_name[wanted]
    elif name is not None and found:
        raise CheckpointError(f"{path / TOKENIZER_CONFIG}: chat_template is a single template; "
                              f"there is none named {name!r}")
    if not found:
        return None
    return _checked(ChatTemplate(str(path / TOKENIZER_CONFIG), found, **tokens))


def _from_gguf(path: Path, kv: dict, name: str | None) -> ChatTemplate | None:
    from llama_jax import gguf_file as gguf

    key = GGUF_KEY if name is None else f"{GGUF_KEY}.{name}"
    if key not in kv:
        if name is not None:
            raise CheckpointError(f"{path}: no {key}")
        return None
    return _checked(ChatTemplate(f"{path} ({key})", kv[key],
                                 gguf.token_named(kv, "bos_token_id") or "",
                                 gguf.token_named(kv, "eos_token_id") or ""))
