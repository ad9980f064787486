"""The OpenAI API's request bodies, as the server reads them, and its error body.

Fields follow the OpenAI API reference (completions and chat completions); `top_k` and `min_p`
are extra fields, as in vLLM. Types are strict (a string where a number goes is refused, not
converted), unknown fields are ignored (clients send fields such as `user`), and fields this
server cannot honour (penalties, `logit_bias`, `suffix`, `best_of` above `n`, the deprecated
`functions`) are refused when set, never silently dropped. A chat request's `response_format`
(`json_object`, `json_schema`) constrains its answer (`response_grammar`); its `tools` and
`tool_choice` are OpenAI's function calling (serve/api.py reads the calls).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llama_jax.decode.grammar import Grammar

MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on a completion's `logprobs`


class OpenAIError(Exception):
    """An error answered with OpenAI's body `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (status, message, param,
                                                                      code, type)
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0, lt=1)
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        return stops

    @model_validator(mode="after")
    def _supported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by this server (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        return self

    @property
    def stops(self) -> list[str]:
        return self.stop or []


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported by this server (only best_of = n)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments):
        try:
            if isinstance(json.loads(arguments), dict):
                return arguments
        except json.JSONDecodeError:
            pass
        raise ValueError("must be the JSON text of an object")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        for part in [] if not isinstance(content, list) else content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content parts of type {part.get('type')!r} are not "
                                 "supported (only text)")
        return content

    @model_validator(mode="after")
    def _complete(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        """The content's text: a string, or the text parts of a list of content parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part["text"] for part in self.content)

    def as_chat(self) -> dict:
        """The message as a chat template reads it: {"role", "content"} with text content
        ("developer" is "system"), an assistant's calls with their arguments as dicts (as
        transformers' templates take them), a tool message's call id and name."""
        out = {"role": "system" if self.role == "developer" else self.role,
               "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in self.tool_calls]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                out["name"] = self.name
        return out


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: Function

    def definition(self) -> dict:
        """The tool as templates read it (OpenAI's shape, unset fields left out)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: dict

    @field_validator("function")
    @classmethod
    def _named(cls, function):
        if not isinstance(function.get("name"), str):
            raise ValueError("a named tool_choice needs function.name")
        return function


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    response_format: Any = None
    # OpenAI's deprecated function calling: refused (a 400 naming the field), never dropped,
    # so a client asking for a call does not get free text back
    functions: Any = None
    function_call: Any = None

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated(cls, value, info):
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported by this server: use tools "
                             "and tool_choice")
        return value

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value):
        response_grammar(value)  # the shape checked here; the schema when it compiles
        return value

    @model_validator(mode="after")
    def _choice_of_tools(self):
        choice = self.tool_choice
        if choice in ("required",) or isinstance(choice, NamedTool):
            if not self.tools:
                raise ValueError("tool_choice names a call to make, but there are no tools")
        if isinstance(choice, NamedTool):
            names = [t.function.name for t in self.tools]
            if choice.function["name"] not in names:
                raise ValueError(f"tool_choice names the function {choice.function['name']!r}"
                                 f", which is not in tools ({', '.join(names)})")
        if self.calls_tools and self.tool_choice != "auto" and self.response_format and (
                self.response_format.get("type") != "text"):
            raise ValueError("response_format constrains the answer's text, and tool_choice "
                             "asks for calls only: give one of them (or tool_choice \"auto\")")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is read for tool calls (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def called_function(self) -> str | None:
        """The function a named tool_choice calls."""
        return self.tool_choice.function["name"] if isinstance(self.tool_choice,
                                                              NamedTool) else None

    def tool_definitions(self) -> list[dict] | None:
        return [t.definition() for t in self.tools] if self.tools else None

    def grammar(self) -> Grammar | None:
        """What `response_format` constrains the answer to (None: free text)."""
        return response_grammar(self.response_format)

    def chat_messages(self) -> list[dict]:
        """The messages as a chat template reads them (`Message.as_chat`)."""
        return [m.as_chat() for m in self.messages]


def response_grammar(value: Any) -> Grammar | None:
    """The grammar of a chat request's `response_format`, as OpenAI defines it: `{"type":
    "text"}` (none), `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}`; a ValueError naming what is wrong."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind != "json_schema":
        raise ValueError("response_format must be {\"type\": \"text\"}, {\"type\": "
                         "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                         "{\"name\": ..., \"schema\": {...}}}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError("response_format.json_schema must be an object with a \"name\"")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema must be a JSON object")
    return Grammar.json_schema(schema)
