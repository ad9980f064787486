"""The OpenAI-compatible HTTP API over an `Engine`: `GET /health`, `GET /metrics`
(Prometheus, serve/metrics.py), `GET /v1/models`, `POST /v1/completions` and
`POST /v1/chat/completions`, streamed as server-sent events
(`data: {...}` chunks, then `data: [DONE]`) when `stream` is true.

Each choice of a request (each prompt, `n` times) is one engine request. Its text is built on
the engine thread as its tokens arrive (`Choice.deliver`: whole characters, cut before a stop
string, which also frees its row at once), and handed to the request's handler through an
asyncio queue. A client that disconnects cancels its choices, and their rows are freed at the
engine's next step. Every 4xx and 5xx carries OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import re
import time
import uuid
from typing import AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llama_jax.data.tokenizer import Tokenizer
from llama_jax.errors import GenerateError
from llama_jax.data.chat import ChatFormat
from llama_jax.serve.chat_reply import ChatReply
from llama_jax.serve.engine import Engine
from llama_jax.serve.outbox import Outbox
from llama_jax.serve.requests import Chunk, QueueFull, Request
from llama_jax.serve.metrics import ServerMetrics
from llama_jax.decode.grammar import Grammar, Matcher, call_grammar, vocabulary
from llama_jax.serve.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from llama_jax.serve.text import StopText

log = logging.getLogger("llama_jax.serve")

UNION_MEMBER = re.compile(r"^(str|int|float|bool|list\[.*|dict\[.*|function-.*)$")
RETRY_AFTER_S = 1  # what a 429 tells the client to wait
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is there


@dataclasses.dataclass
class Event:
    """What one `deliver` released for choice `index`: text, the tokens `first..last - 1` of
    the choice, and the finish reason or error once it is over."""

    index: int
    text: str
    first: int
    last: int
    finish_reason: str | None = None
    error: BaseException | None = None


class Choice:
    """One choice: its engine request, and its tokens, log-probabilities and text so far."""

    def __init__(self, index: int, prompt: Sequence[int], stops: Sequence[str],
                 tokenizer: Tokenizer, events: asyncio.Queue, outbox: Outbox, per_token: bool,
                 metrics: ServerMetrics):
        self.index, self.prompt = index, list(prompt)
        self._metrics, self._since = metrics, time.perf_counter()  # submission, then delivery
        self.text = StopText(tokenizer, prompt, stops)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.offsets: list[int] = []  # where each token's text begins, in the generated text
        self.finish_reason: str | None = None
        self.limit: int | None = None  # tokens to keep (0: the prompt's scores alone)
        self.prompt_logprobs: list[float] = []
        self.prompt_top: list[list[tuple[int, float]]] = []
        self._events, self._outbox = events, outbox
        self._per_token = per_token or bool(stops)  # find the token a stop string ends in
        self.request: Request | None = None
        self.echo = ""  # a completion with `echo`: its prompt's text, sent before its own

    def deliver(self, chunk: Chunk) -> bool:
        """On the engine thread: takes a chunk's tokens; True once a stop string appeared."""
        if self.finish_reason is not None:
            return True
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top = chunk.prompt_logprobs, chunk.prompt_top or []
        if self.limit is not None and chunk.tokens:
            chunk = dataclasses.replace(chunk, tokens=[], finish_reason="length")
        first, text = len(self.tokens), ""
        groups = [[t] for t in chunk.tokens] if self._per_token else [chunk.tokens]
        for group in groups:
            if not group:
                continue
            self.offsets += [self.text.decoded] * len(group)
            text += self.text.push(group)
            at = len(self.tokens)
            self.tokens += group
            self.logprobs += chunk.logprobs[at - first:at - first + len(group)]
            self.top += chunk.top[at - first:at - first + len(group)]
            if self.text.stopped:
                self.finish_reason = "stop"
                break
        if self.finish_reason is None and (chunk.finish_reason or chunk.error):
            text += self.text.flush()
            self.finish_reason = chunk.finish_reason or "error"
        if len(self.tokens) > first:
            now = time.perf_counter()
            self._metrics.delivered(first == 0, len(self.tokens) - first, now - self._since)
            self._since = now
        self._outbox.post(self._events, Event(self.index, text, first, len(self.tokens),
                                              self.finish_reason, chunk.error))
        return self.text.stopped


class Server:
    """The API's state (the engine, the tokenizer, the served name and chat format) and its
    endpoints, one method each, which `create_app` routes to."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str,
                 chat_format: ChatFormat):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.chat_format = chat_format
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine)
        self._outbox: Outbox | None = None  # of the event loop serving the requests

    # ------------------------------------------------------------------------ endpoints

    async def health(self) -> dict:
        return {"status": "ok", **self.engine.stats()}

    async def prometheus(self) -> Response:
        """GET /metrics: the counters in Prometheus's text format (serve/metrics.py)."""
        content, media_type = self.metrics.text()
        return Response(content, media_type=media_type)

    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "llama_jax", "max_model_len": self.engine.max_seq_len}]}

    async def completions(self, body: CompletionRequest, http: HttpRequest):
        """POST /v1/completions: `n` choices per prompt, the prompt echoed before each when
        asked (with its log-probabilities too when `logprobs` is given)."""
        self._check_model(body.model)
        texts = body.prompts()
        prompts = [self._encode(p) for p in texts]
        if not all(prompts):
            raise OpenAIError(400, "a prompt is empty", "prompt")
        limits = [self._limit(p, body.max_tokens, "max_tokens", "prompt") for p in prompts]
        if body.max_tokens == 0 and not body.echo:
            raise OpenAIError(400, "max_tokens=0 generates nothing: it needs echo", "max_tokens")
        scored = body.echo and body.logprobs is not None  # the prompt's logprobs too
        choices, events = self._start(prompts, limits, body, body.logprobs or 0,
                                      body.logprobs is not None, scored)
        for choice in choices if body.echo else ():
            text = texts[choice.index // body.n]
            choice.echo = text if isinstance(text, str) else self.tokenizer.decode(choice.prompt)
        head = _head("cmpl", "text_completion", self.model_name)
        as_json = functools.partial(self._completion_choice, body.logprobs is not None)
        if not body.stream:
            await _finished(choices, events, http)
            return {**head, "choices": [as_json(c, c.echo + c.text.text, 0, len(c.tokens),
                                                c.finish_reason, scored) for c in choices],
                    "usage": self._usage(prompts, choices)}
        echoed = set()  # the prompt goes first, with its logprobs once they are in

        def chunks(event: Event) -> list[dict]:
            choice, out = choices[event.index], []
            if body.echo and event.index not in echoed:
                echoed.add(event.index)
                out.append(as_json(choice, choice.echo, 0, 0, None, scored))
            if _news(event):
                out.append(as_json(choice, event.text, event.first, event.last,
                                   event.finish_reason))
            return out

        return _streamed(head, [], chunks, choices, events, http, body,
                         functools.partial(self._usage, prompts, choices))

    async def chat_completions(self, body: ChatCompletionRequest, http: HttpRequest):
        """POST /v1/chat/completions: `n` replies to the messages, in the checkpoint's chat
        format (with the tools, read for the calls made; serve/chat_reply.py); streamed, each
        reply opens with an empty assistant delta."""
        self._check_model(body.model)
        try:
            prompt = self.chat_format(body.chat_messages(), body.tool_definitions())
        except GenerateError as e:
            raise OpenAIError(400, str(e), "messages") from None
        limit = self._limit(prompt, body.limit, "max_completion_tokens", "messages")
        top = (body.top_logprobs or 0) if body.logprobs else 0
        grammar, param = self._chat_grammar(body)
        choices, events = self._start([prompt], [limit], body, top, body.logprobs,
                                      grammar=grammar, grammar_param=param)
        head = _head("chatcmpl", "chat.completion", self.model_name)
        form = self.chat_format.tool_format if body.calls_tools else None
        replies = [ChatReply(form) for _ in choices]

        def logprobs(choice: Choice, first: int, last: int) -> dict | None:
            return self.chat_logprobs(choice, first, last) if body.logprobs else None

        def finished(choice: Choice) -> str | None:
            choice.finish_reason = replies[choice.index].finish_reason(choice.finish_reason)
            return choice.finish_reason

        if not body.stream:
            await _finished(choices, events, http)
            return {**head, "choices": [{"index": c.index,
                                         "message": replies[c.index].message(c.text.text),
                                         "logprobs": logprobs(c, 0, len(c.tokens)),
                                         "finish_reason": finished(c)} for c in choices],
                    "usage": self._usage([prompt], choices)}
        opening = [{"index": c.index, "logprobs": None,
                    "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                   for c in choices]

        def chunks(event: Event) -> list[dict]:
            if not _news(event):
                return []
            choice, last = choices[event.index], event.finish_reason is not None
            out = [{"index": event.index, "delta": delta, "logprobs": None,
                    "finish_reason": None}
                   for delta in replies[event.index].deltas(event.text, last)] or [
                {"index": event.index, "delta": {}, "logprobs": None, "finish_reason": None}]
            out[0]["logprobs"] = logprobs(choice, event.first, event.last)
            out[-1]["finish_reason"] = finished(choice) if last else None
            return out

        return _streamed({**head, "object": "chat.completion.chunk"}, opening, chunks, choices,
                         events, http, body, functools.partial(self._usage, [prompt], choices))

    def _chat_grammar(self, body: ChatCompletionRequest) -> tuple[Grammar | None, str]:
        """What a chat answer is constrained to, and the request field that asked for it:
        calls of the tools for tool_choice "required" or a named function, calls or the
        response_format for "auto" with one, the response_format alone otherwise. Each tool's
        parameter schema is checked first (a 400 naming the tool)."""
        tools = body.tool_definitions() or []
        for i, tool in enumerate(tools):
            parameters = tool["function"].get("parameters")
            if parameters is not None:
                self._matcher_of(Grammar.json_schema(parameters),
                                 f"tools[{i}].function.parameters",
                                 f" (function {tool['function']['name']!r})")
        content = body.grammar()
        if not body.calls_tools or body.tool_choice in (None, "auto") and content is None:
            return content, "response_format"
        schema = None if content is None else json.loads(content.source)
        return call_grammar(self.chat_format.tool_format, tools, body.called_function,
                            body.parallel_tool_calls, schema), "tool_choice"

    # ------------------------------------------------------------------------ requests

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise OpenAIError(404, f"The model {name!r} does not exist; this server serves "
                                   f"{self.model_name!r}", "model", "model_not_found")

    def _encode(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt, bos=True) if isinstance(prompt, str) else prompt

    def _limit(self, prompt: list[int], max_tokens: int | None, param: str,
               prompt_param: str) -> int:
        """The tokens to generate for `prompt`: `max_tokens`, or all that fit (None)."""
        context = self.engine.max_seq_len
        if len(prompt) >= context:
            raise OpenAIError(400, f"This model's maximum context length is {context} tokens; "
                                   f"the prompt has {len(prompt)} tokens", prompt_param,
                              "context_length_exceeded")
        if max_tokens is None:
            return context - len(prompt)
        if len(prompt) + max_tokens > context:
            raise OpenAIError(400, f"This model's maximum context length is {context} tokens; "
                                   f"the prompt has {len(prompt)} tokens and {max_tokens} were "
                                   f"asked for ({len(prompt) + max_tokens} in all)", param,
                              "context_length_exceeded")
        return max_tokens

    def _start(self, prompts: list[list[int]], limits: list[int], body, top_logprobs: int,
               per_token: bool, score_prompt: bool = False, grammar: Grammar | None = None,
               grammar_param: str = "response_format") -> tuple[list[Choice], asyncio.Queue]:
        """Submits `n` choices per prompt (each under `grammar`, which the request's
        `grammar_param` asked for); refuses all of them if the queue cannot take them."""
        if body.n > self.engine.max_batch:
            raise OpenAIError(400, f"n={body.n} is more than this server's "
                                   f"{self.engine.max_batch} decode rows", "n")
        matcher = None if grammar is None else self._matcher_of(grammar, grammar_param)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        if self._outbox is None or self._outbox.loop is not loop:
            self._outbox = Outbox(loop)
        seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(4), "little")
        choices = []
        for p, (prompt, limit) in enumerate(zip(prompts, limits)):
            for j in range(body.n):
                choice = Choice(len(choices), prompt, body.stops, self.tokenizer, events,
                                self._outbox, per_token, self.metrics)
                if limit == 0:  # the prompt alone: one token is decoded and dropped
                    choice.limit, limit = 0, 1
                choice.request = Request(
                    prompt, limit, choice.deliver, temperature=body.temperature,
                    top_k=max(body.top_k, 0), top_p=body.top_p, min_p=body.min_p,
                    seed=seed + j, top_logprobs=top_logprobs, prompt_logprobs=score_prompt,
                    matcher=None if matcher is None else matcher())
                choices.append(choice)
        submitted = []
        try:  # a prompt's n choices share one prefill
            for first in range(0, len(choices), body.n):
                group = [choice.request for choice in choices[first:first + body.n]]
                self.engine.submit_group(group)
                submitted += group
        except QueueFull:
            for request in submitted:
                request.cancel()
            raise OpenAIError(429, "The server is busy: too many requests are waiting; retry "
                                   "later", code="rate_limit_exceeded", type="rate_limit_error",
                              headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except GenerateError as e:
            for request in submitted:
                request.cancel()
            raise OpenAIError(400, str(e)) from None
        return choices, events

    def _matcher_of(self, grammar: Grammar, param: str, what: str = ""
                    ) -> Callable[[], Matcher]:
        """A maker of fresh matchers of `grammar` (one per choice), or a 400 naming the
        request's `param` (and `what` it is) when it does not compile."""
        try:
            vocab = vocabulary(self.tokenizer, self.engine.config.vocab_size,
                               self.engine.stop_ids)
            start = Matcher(grammar, vocab)
        except GenerateError as e:
            raise OpenAIError(400, f"{param}{what}: {e}", param) from None
        return start.copy  # `start` itself is never advanced

    # ------------------------------------------------------------------------ responses

    def _usage(self, prompts: list[list[int]], choices: list[Choice]) -> dict:
        """A complete response's usage, counted in the metrics as it is given."""
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c.tokens) for c in choices)
        # A prompt's choices share its prefill: its first choice's hit is the prompt's.
        cached = sum(c.request.cached_tokens for c in choices[::len(choices) // len(prompts)])
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.engine.spec is not None:  # speculative guesses, as OpenAI's predicted outputs
            accepted = sum(c.request.accepted_tokens for c in choices)
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": sum(c.request.drafted_tokens
                                                  for c in choices) - accepted}
        self.metrics.completed(usage, [c.finish_reason for c in choices])
        return usage

    def _token_text(self, token: int) -> str:
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")

    def _completion_choice(self, logprobs: bool, choice: Choice, text: str, first: int,
                           last: int, finish: str | None, prompt: bool = False) -> dict:
        """A completion's choice with `text`, the tokens first..last - 1 (and with `prompt`,
        the prompt's) scored when `logprobs`."""
        scores = self.completion_logprobs(choice, first, last, len(choice.echo),
                                          prompt) if logprobs else None
        return {"index": choice.index, "text": text, "logprobs": scores,
                "finish_reason": finish}

    def completion_logprobs(self, choice: Choice, first: int, last: int, offset: int,
                            prompt: bool = False) -> dict:
        """OpenAI's `logprobs` of tokens first..last - 1, whose text starts at `offset`; with
        `prompt`, the prompt's tokens first (the first has no log-probability)."""
        tops = lambda pairs: {self._token_text(t): lp for t, lp in pairs}  # noqa: E731
        out = {"tokens": [self._token_text(t) for t in choice.tokens[first:last]],
               "token_logprobs": choice.logprobs[first:last],
               "top_logprobs": [tops(top) for top in choice.top[first:last]] or None,
               "text_offset": [offset + o for o in choice.offsets[first:last]]}
        if not prompt:
            return out
        return {"tokens": [self._token_text(t) for t in choice.prompt] + out["tokens"],
                "token_logprobs": [None, *choice.prompt_logprobs, *out["token_logprobs"]],
                "top_logprobs": [None, *map(tops, choice.prompt_top),
                                 *(out["top_logprobs"] or [{}] * (last - first))],
                "text_offset": self._offsets(choice.prompt) + out["text_offset"]}

    def _offsets(self, ids: Sequence[int]) -> list[int]:
        """Where each token's text begins in the text of `ids`."""
        text, offsets = StopText(self.tokenizer, []), []
        for token in ids:
            offsets.append(text.decoded)
            text.push([token])
        return offsets

    def chat_logprobs(self, choice: Choice, first: int, last: int) -> dict:
        def entry(token: int, logprob: float) -> dict:
            raw = self.tokenizer.token_bytes(token)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                    "bytes": list(raw)}
        tops = choice.top[first:last] or [[]] * (last - first)
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(*alt) for alt in top]}
                            for t, lp, top in zip(choice.tokens[first:last],
                                                  choice.logprobs[first:last], tops)]}


def _head(prefix: str, kind: str, model: str) -> dict:
    """The fields every response (and every chunk of a streamed one) starts with."""
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": model}


def _news(event: Event) -> bool:
    """Whether an event has anything to stream: text, tokens or the end."""
    return bool(event.text or event.last > event.first or event.finish_reason)


async def _events(choices: list[Choice], events: asyncio.Queue, http: HttpRequest,
                  poll_disconnect: bool) -> AsyncIterator[Event]:
    """The choices' events until every choice finished. Cancels every choice when the client
    goes (or this generator is closed early)."""
    open_choices = {c.index for c in choices}
    try:
        while open_choices:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if poll_disconnect and await http.is_disconnected():
                    return
                continue
            if event.finish_reason is not None or event.error is not None:
                open_choices.discard(event.index)
            yield event
    finally:
        for choice in choices:
            if choice.request is not None:
                choice.request.cancel()


async def _finished(choices: list[Choice], events: asyncio.Queue, http: HttpRequest) -> None:
    """Waits until every choice of a non-streaming request finished; a failure raises."""
    async for event in _events(choices, events, http, poll_disconnect=True):
        if event.error is not None:
            raise _failure(event)


def _failure(event: Event) -> OpenAIError:
    log.error("a request failed: %r", event.error)
    return OpenAIError(500, f"The engine failed on this request: {event.error}",
                       type="server_error")


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _streamed(head: dict, opening: list[dict], chunks: Callable[[Event], list[dict]],
              choices: list[Choice], events: asyncio.Queue, http: HttpRequest, body,
              usage: Callable[[], dict]) -> StreamingResponse:
    """A streamed response: a chunk for each `opening` choice, then for each of the choices
    that `chunks` makes of an event (a failure's error body instead), the usage (`usage()`,
    taken once the choices are done, whether or not the client asked for it), and
    `[DONE]`."""
    async def stream() -> AsyncIterator[str]:
        for choice in opening:
            yield _sse({**head, "choices": [choice]})
        async for event in _events(choices, events, http, poll_disconnect=False):
            if event.error is not None:
                yield _sse(_failure(event).body())
                continue
            for choice in chunks(event):
                yield _sse({**head, "choices": [choice]})
        counted = usage()
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": counted})
        yield _sse("[DONE]")
    return StreamingResponse(stream(), media_type="text/event-stream")


async def _openai_error(_, e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _invalid(_, e: RequestValidationError) -> JSONResponse:
    """A request that does not parse: OpenAI's 400 body, naming the first bad field."""
    error = e.errors()[0]
    # The field's path, without the names of the union members pydantic tried ("str").
    where = ".".join(str(x) for x in error.get("loc", ())[1:] if not UNION_MEMBER.match(str(x)))
    if error.get("type") == "json_invalid":
        message = f"The body is not valid JSON: {error.get('ctx', {}).get('error', '')}"
    else:
        message = f"{where}: {error.get('msg')}" if where else error.get("msg")
    return JSONResponse(OpenAIError(400, message, where or None).body(), status_code=400)


def create_app(server: Server) -> FastAPI:
    """The FastAPI application of `server`."""
    app = FastAPI(title="llama_jax", docs_url=None, redoc_url=None)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.get("/health")(server.health)
    app.get("/metrics")(server.prometheus)
    app.get("/v1/models")(server.models)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    return app
