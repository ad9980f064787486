"""Chat prompts: OpenAI `messages` as the token ids of the model's chat format.

- The checkpoint's own chat template when it has one (`load_chat_template`: its
  `chat_template.jinja`, `tokenizer_config.json` or GGUF metadata), rendered as transformers
  renders it with `add_generation_prompt=True`; the names of control tokens in the result
  (`<|eot_id|>`, `<s>`, ...) become those tokens, and BOS comes only from the template, as
  with `apply_chat_template(tokenize=True)`.
- Otherwise Meta's formats (llama-models' `ChatFormat`): LLaMA 3's headers for a tiktoken
  tokenizer (`<|start_header_id|>role<|end_header_id|>\\n\\n` + the content as given +
  `<|eot_id|>`, then the assistant's header), LLaMA 2's `[INST]` turns for a SentencePiece one
  (a system message folded into the first user turn between `<<SYS>>` markers; turns must
  alternate user, assistant, ..., user).

Tools (OpenAI's function definitions) are rendered by the template where it renders them, and
in a system message of our own otherwise (data/tool_calls.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Sequence

from llama_jax.data.chat_template import load_chat_template
from llama_jax.data.tool_calls import ToolFormat, tool_format, tool_prompt
from llama_jax.data.tokenizer import Llama3Tokenizer, Tokenizer
from llama_jax.errors import GenerateError

ROLES = ("system", "user", "assistant")


class ChatFormat:
    """A checkpoint's chat format: `format(messages, tools=None)` is the prompt's ids. Messages
    are {"role", "content"}, and for tool calling an assistant's `tool_calls` (OpenAI's, with
    `arguments` as a dict) and `tool` messages with the results; `tools` are OpenAI's function
    definitions. `tool_format` says how the model writes a call (data/tool_calls.py)."""

    def __init__(self, encode: Callable[[Sequence[dict], dict], list[int]],
                 tool_format: ToolFormat):
        self._encode, self.tool_format = encode, tool_format

    def __call__(self, messages: Sequence[dict], tools: Sequence[dict] | None = None
                 ) -> list[int]:
        return self._encode(*tool_prompt(self.tool_format, messages, tools))


def chat_format(checkpoint: str | Path, tokenizer: Tokenizer) -> ChatFormat:
    """The chat format of a checkpoint (directory or GGUF file) and its tokenizer (see the
    module doc)."""
    template = load_chat_template(checkpoint) if Path(checkpoint).exists() else None
    if template is not None:
        return ChatFormat(lambda messages, extra: encode_with_special_tokens(
            tokenizer, template.render(messages, **extra)), tool_format(template.text))
    meta = llama3_chat if isinstance(tokenizer, Llama3Tokenizer) else llama2_chat
    return ChatFormat(lambda messages, _: meta(tokenizer, messages), tool_format(None))


def llama3_chat(tokenizer: Tokenizer, messages: Sequence[dict]) -> list[int]:
    special = tokenizer.special_tokens

    def header(role: str) -> list[int]:
        return ([special["<|start_header_id|>"]] + tokenizer.encode(role, bos=False)
                + [special["<|end_header_id|>"]] + tokenizer.encode("\n\n", bos=False))

    ids = [tokenizer.bos_id]
    for message in messages:
        ids += (header(message["role"]) + tokenizer.encode(message["content"], bos=False)
                + [special["<|eot_id|>"]])
    return ids + header("assistant")


def llama2_chat(tokenizer: Tokenizer, messages: Sequence[dict]) -> list[int]:
    turns = list(messages)
    if turns and turns[0]["role"] == "system":
        if len(turns) < 2:
            raise GenerateError("messages: a system message must be followed by a user message")
        system = f"<<SYS>>\n{turns[0]['content']}\n<</SYS>>\n\n"
        turns = [{"role": turns[1]["role"], "content": system + turns[1]["content"]}, *turns[2:]]
    for i, message in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise GenerateError(f"messages[{i}]: the LLaMA 2 chat format needs turns that "
                                f"alternate user, assistant, ...; got role "
                                f"{message['role']!r} where {expected!r} goes")
    if len(turns) % 2 == 0:
        raise GenerateError("messages: the LLaMA 2 chat format needs the last message to be "
                            "the user's")
    ids = []
    for prompt, answer in zip(turns[:-1:2], turns[1::2]):
        ids += tokenizer.encode(f"[INST] {prompt['content'].strip()} [/INST] "
                                f"{answer['content'].strip()} ", bos=True, eos=True)
    return ids + tokenizer.encode(f"[INST] {turns[-1]['content'].strip()} [/INST]", bos=True)


def encode_with_special_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` as ids, the names of control tokens in it as those tokens and the rest encoded
    as text (without BOS)."""
    names = sorted(tokenizer.special_tokens, key=len, reverse=True)
    if not names:
        return tokenizer.encode(text, bos=False)
    ids = []
    for i, part in enumerate(re.split("(" + "|".join(map(re.escape, names)) + ")", text)):
        if i % 2:
            ids.append(tokenizer.special_tokens[part])
        elif part:
            ids += tokenizer.encode(part, bos=False)
    return ids
