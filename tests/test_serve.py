"""The OpenAI-compatible server, live: `python -m llama_jax.serve` started on 127.0.0.1 and a free
port, talked to with the real `openai` client, and stopped, inside the tests. Every wait is
bounded, so a hang fails a test instead of the suite.

Its answers equal `generate` (greedy tokens and their log-probabilities, through the
tokenizer), streamed equals not streamed, stop strings cut exactly, concurrent requests each
equal their answer alone, a seeded sample is the same alone and in a busy server, a client
that disconnects frees its slot, bad requests get OpenAI's error body and the server goes on,
a full queue answers 429, and SIGTERM lets the requests in flight finish and exits 0."""

import asyncio
import math
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import pytest

import llama_jax
from llama_jax.data.tokenizer import TextStream
from llama_jax.decode.generate import generate
from llama_jax.data.chat import llama2_chat
from checkpoints import tiny_checkpoint_with_tokenizer

openai = pytest.importorskip("openai")

MAX_SEQ_LEN = 96
CHUNK = 16
SLOTS = 4
START_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint_with_tokenizer(tmp_path_factory.mktemp("serve") / "m")


@pytest.fixture(scope="module")
def model(checkpoint):
    config, params = llama_jax.load_checkpoint(checkpoint)
    return config, params, llama_jax.load_tokenizer(checkpoint)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """A server process and a client for it."""

    def __init__(self, checkpoint, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llama_jax.serve", "--checkpoint", str(checkpoint),
             "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "tiny",
             "--max-seq-len", str(MAX_SEQ_LEN), "--steps-per-dispatch", "4",
             "--log-level", "warning", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(START_TIMEOUT_S):
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.lines[-30:]))
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                                    timeout=REQUEST_TIMEOUT_S)

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("serving tiny on http://127.0.0.1:"):
                self.ready.set()
        self.ready.set()  # exited: the wait ends and the test fails on what it printed

    def aclient(self):
        """An async client: one per event loop (`asyncio.run`), which its connections belong
        to."""
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)


@pytest.fixture(scope="module")
def server(checkpoint):
    # Chunks of 16 tokens: prompts longer than that prefill in chunks and fill the prefix cache.
    live = Live(checkpoint, "--max-batch", str(SLOTS), "--max-queue", "64",
                "--prefill-chunk", str(CHUNK))
    yield live
    assert live.stop() == 0, "".join(live.lines[-30:])


def continuation(tokenizer, prompt_ids, tokens) -> str:
    text = TextStream(tokenizer, prompt_ids)
    return text.push(tokens) + text.flush()


def reference(model, prompt_ids, max_tokens, **sampling):
    """What `generate` gives alone: tokens, log-probabilities and text."""
    config, params, tokenizer = model
    (tokens,), (logprobs,) = generate(config, params, [prompt_ids], max_tokens,
                                      return_logprobs=True, **sampling)
    return tokens, logprobs, continuation(tokenizer, prompt_ids, tokens)


PROMPTS = ["The cat", "A dog is", "Numbers: 12", "The mat and the", "a proud one", "looked"]


def test_health_and_models(server):
    assert server.health()["status"] == "ok"
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def scrape(server) -> dict[str, float]:
    """GET /metrics: every sample by name and labels, e.g. `llama_jax_choices_total{stop}`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_what_the_responses_report(server):
    """The counters grow by the sums of the responses' usage and their choices' finish
    reasons, streamed or not; every choice with tokens times its first token and each later
    one; the gauges read the engine."""
    before = scrape(server)
    whole = server.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12,
                                             temperature=0.9, seed=1, n=2)
    chat = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=9,
        temperature=0, stop=["\u2603"])
    streamed = [c for c in server.client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True}) if c.usage]
    after = scrape(server)
    usages = [whole.usage, chat.usage, streamed[0].usage]
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert grew["llama_jax_prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert grew["llama_jax_generation_tokens_total"] == generated
    reasons = [c.finish_reason for c in whole.choices + chat.choices] + ["length"]
    assert sum(v for k, v in grew.items() if k.startswith("llama_jax_choices_total")) == 4
    for reason in set(reasons):
        assert grew[f"llama_jax_choices_total{{{reason}}}"] == reasons.count(reason)
    assert grew["llama_jax_time_to_first_token_seconds_count"] == 4
    assert grew["llama_jax_inter_token_latency_seconds_count"] == generated - 4
    assert after["llama_jax_slots"] == SLOTS and after["llama_jax_queue_length"] == 0
    assert after["llama_jax_requests_running"] == after["llama_jax_requests_waiting"] == 0
    assert after["llama_jax_preemptions_total"] == 0
    # Idle, the pages held are the prefix cache's: a chunk of CHUNK tokens is a page of 16.
    assert after["llama_jax_kv_pages_used"] == after["llama_jax_prefix_cache_blocks_used"]
    health = server.health()
    assert health["kv_pages_total"] == after["llama_jax_kv_pages_total"] >= SLOTS
    assert health["kv_pages_used"] == after["llama_jax_kv_pages_used"]
    assert grew["llama_jax_cached_prompt_tokens_total"] == sum(
        u.prompt_tokens_details.cached_tokens for u in usages)
    # Three prompts (the n=2 choices share one prefill), each in chunks of CHUNK tokens.
    assert grew["llama_jax_prefill_chunks_total"] == sum(
        -(-(u.prompt_tokens - u.prompt_tokens_details.cached_tokens) // CHUNK) for u in usages)


def test_a_repeated_prompt_is_restored_from_the_prefix_cache(server, model):
    """A 45-token prompt (two full chunks and a part) sent twice: the second restores the two
    chunks (usage, /metrics) and returns the same tokens and log-probabilities, bit for bit;
    its `n=3` sampled choices prefill it once and each equals a request with seed + j."""
    config, params, tokenizer = model
    ids = np.random.default_rng(8).integers(3, config.vocab_size, 45).tolist()
    before = scrape(server)
    cold, warm = (server.client.completions.create(model="tiny", prompt=ids, max_tokens=6,
                                                   temperature=0, logprobs=2)
                  for _ in range(2))
    grew = {k: v - before.get(k, 0.0) for k, v in scrape(server).items()}
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == 2 * CHUNK
    assert warm.choices[0].text == cold.choices[0].text == reference(model, ids, 6)[2]
    assert warm.choices[0].logprobs == cold.choices[0].logprobs
    assert grew["llama_jax_prefix_cache_lookups_total"] == 2
    assert grew["llama_jax_prefix_cache_hits_total"] == 1
    assert grew["llama_jax_prefix_cache_hit_tokens_total"] == 2 * CHUNK
    assert grew["llama_jax_prefill_chunks_total"] == 3 + 1
    before = scrape(server)
    three = server.client.completions.create(model="tiny", prompt=ids, max_tokens=6,
                                             temperature=1.0, n=3, seed=11)
    assert scrape(server)["llama_jax_prefill_chunks_total"] == \
        before["llama_jax_prefill_chunks_total"] + 1
    assert three.usage.prompt_tokens_details.cached_tokens == 2 * CHUNK
    for j, choice in enumerate(three.choices):
        alone = server.client.completions.create(model="tiny", prompt=ids, max_tokens=6,
                                                 temperature=1.0, seed=11 + j)
        assert choice.text == alone.choices[0].text


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_completion_equals_generate(server, model, prompt):
    """Text, token log-probabilities and usage equal `generate` alone."""
    tokenizer = model[2]
    ids = tokenizer.encode(prompt)
    tokens, logprobs, text = reference(model, ids, 40)
    out = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                           temperature=0, logprobs=0)
    choice = out.choices[0]
    assert choice.text == text
    assert choice.finish_reason == ("length" if len(tokens) == 40 else "stop")
    assert len(choice.logprobs.token_logprobs) == len(tokens)
    assert all(math.isclose(a, b, abs_tol=1e-4)
               for a, b in zip(choice.logprobs.token_logprobs, logprobs))
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(tokens)
    assert out.usage.total_tokens == len(ids) + len(tokens)


def test_token_id_prompts_and_echo(server, model):
    """A prompt of token ids is read as those ids; `echo` puts the prompt's text first; a list
    of prompts gets one choice each, in order."""
    tokenizer = model[2]
    ids = [tokenizer.encode(p) for p in PROMPTS[:2]]
    out = server.client.completions.create(model="tiny", prompt=ids, max_tokens=10,
                                           temperature=0, echo=True)
    for choice, prompt in zip(out.choices, ids):
        assert choice.text == tokenizer.decode(prompt) + reference(model, prompt, 10)[2]
    assert [c.index for c in out.choices] == [0, 1]


def test_echo_with_logprobs_scores_the_prompt(server, model):
    """lm-eval's `local-completions` log-likelihood request: token ids, echo, logprobs=1,
    max_tokens 0 (or 1): each prompt token's log-probability given those before it, and the
    most likely token at each position, as the full forward computes them."""
    config, params, tokenizer = model
    ids = tokenizer.encode(PROMPTS[2] + " and more words")
    logprobs_TV = np.asarray(jax.nn.log_softmax(llama_jax.forward(config, params,
                                                                  np.asarray([ids]))[0], -1))
    for max_tokens in (0, 1):
        out = server.client.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens,
                                               temperature=0, logprobs=1, echo=True)
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and lp.token_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:len(ids)],
                                   logprobs_TV[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
        for top, row in zip(lp.top_logprobs[1:len(ids)], logprobs_TV):
            assert list(top.values()) == pytest.approx([row.max()], abs=1e-4)
        assert lp.text_offset[:len(ids)] == sorted(lp.text_offset[:len(ids)])
        assert out.choices[0].text.startswith(tokenizer.decode(ids))


def test_chat_completion_equals_generate_on_the_chat_prompt(server, model):
    """No chat template in the checkpoint and a SentencePiece tokenizer: LLaMA 2's format."""
    tokenizer = model[2]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "The cat sat"}]
    ids = llama2_chat(tokenizer, messages)
    tokens, logprobs, text = reference(model, ids, 24)
    out = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                                temperature=0, logprobs=True, top_logprobs=3)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert [round(c.logprob, 4) for c in choice.logprobs.content] == [round(x, 4)
                                                                      for x in logprobs]
    for entry in choice.logprobs.content:  # the chosen (greedy) token is the most likely
        assert len(entry.top_logprobs) == 3
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-5)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert out.usage.prompt_tokens == len(ids)


def test_streaming_equals_not_streaming(server):
    kwargs = dict(model="tiny", prompt=PROMPTS[3], max_tokens=30, temperature=0.8, seed=5)
    whole = server.client.completions.create(**kwargs)
    chunks = list(server.client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    messages = [{"role": "user", "content": PROMPTS[4]}]
    chat = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                                 temperature=0)
    streamed = list(server.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        chat.choices[0].message.content
    assert streamed[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_the_stream_ends_with_done(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                      json={"model": "tiny", "prompt": "The", "max_tokens": 5,
                            "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_stop_strings_cut_exactly(server, model):
    """The text ends right before the first stop string, streamed or not, and a stream never
    shows any of it."""
    full = reference(model, model[2].encode(PROMPTS[0]), 60)[2]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    expected = full[:full.index(stop)]
    kwargs = dict(model="tiny", prompt=PROMPTS[0], max_tokens=60, temperature=0,
                  stop=[stop, "never appears \u2603"])
    out = server.client.completions.create(**kwargs)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in server.client.completions.create(stream=True, **kwargs)]
    assert "".join(pieces) == expected


def test_concurrent_streams_each_equal_their_answer_alone(server, model):
    """32 streaming requests of different lengths through 4 slots: each equals `generate`
    alone."""
    tokenizer = model[2]
    cases = [(PROMPTS[i % len(PROMPTS)] + " " * (i % 3), 4 + 3 * i % 37) for i in range(32)]
    for (prompt, max_tokens), text in zip(cases, concurrent_streams(server, cases)):
        assert text == reference(model, tokenizer.encode(prompt), max_tokens)[2]


def concurrent_streams(live, cases) -> list[str]:
    """The texts of greedy streaming completions of `(prompt, max_tokens)` sent at once."""
    async def one(client, prompt, max_tokens):
        stream = await client.completions.create(model="tiny", prompt=prompt,
                                                 max_tokens=max_tokens, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them():
        client = live.aclient()
        return await asyncio.wait_for(asyncio.gather(*(one(client, *c) for c in cases)), 180)

    return asyncio.run(all_of_them())


def test_a_seeded_sample_is_the_same_alone_and_in_a_busy_server(server, model):
    """...and equals `generate` with that seed: its key is its own, folded with its step."""
    kwargs = dict(model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=0.9, top_p=0.9,
                  seed=1234)
    alone = server.client.completions.create(**kwargs).choices[0].text
    expected = reference(model, model[2].encode(PROMPTS[1]), 30, temperature=0.9, top_p=0.9,
                         seed=1234)[2]
    assert alone == expected

    async def busy():
        client = server.aclient()
        others = [client.completions.create(model="tiny", prompt=p, max_tokens=40,
                                                    temperature=1.0, seed=i,
                                                    extra_body={"top_k": 5})
                  for i, p in enumerate(PROMPTS)]
        return await asyncio.wait_for(asyncio.gather(
            *others[:3], client.completions.create(**kwargs), *others[3:]), 120)

    assert asyncio.run(busy())[3].choices[0].text == alone


def test_n_choices_differ_and_count_in_usage(server):
    out = server.client.completions.create(model="tiny", prompt="The cat", max_tokens=12,
                                           temperature=1.0, n=3, seed=3, logprobs=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)


def wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_disconnect_frees_the_slot(server):
    """A client that goes mid-stream is cancelled and its slot freed, long before its
    tokens would have run out."""
    before = server.health()["finished"].get("cancelled", 0)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                      json={"model": "tiny", "prompt": "The", "max_tokens": MAX_SEQ_LEN - 8,
                            "stream": True, "temperature": 0, "stop": ["\u2603"]}) as response:
        next(response.iter_lines())
    assert wait_for(lambda: server.health()["finished"].get("cancelled", 0) == before + 1)
    assert wait_for(lambda: server.health()["slots_in_use"] == 0)


BAD_REQUESTS = [
    ("completions", b'{"model": "tiny", "prompt": "x", ', 400, None),  # malformed JSON
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": 3}, 400, "prompt"),
    ("completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("completions", {"model": "tiny", "prompt": "x", "n": SLOTS + 1}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": MAX_SEQ_LEN}, 400,
     "max_tokens"),
    ("completions", {"model": "tiny", "prompt": list(range(3, 3 + MAX_SEQ_LEN))}, 400,
     "prompt"),
    ("completions", {"model": "tiny", "prompt": [1, 400]}, 400, None),  # outside the vocab
    ("completions", {"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop"),
    ("completions", {"model": "tiny", "prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"model": "tiny", "prompt": "x", "presence_penalty": 0.5}, 400, None),
    ("chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
     400, "messages.0.role"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "assistant", "content": "x"}]},
     400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                          "top_logprobs": 21}, 400, "top_logprobs"),
    *(("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                            field: value}, 400, field) for field, value in (
        ("functions", [{"name": "f"}]), ("function_call", "auto"),
        ("response_format", {"type": "xml"}),
        ("response_format", {"type": "json_schema"}),
        ("response_format", {"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "strin"}}}))),
    *(("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                            **fields}, 400, param) for fields, param in (
        ({"tool_choice": "required"}, None),  # no tools to call
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
         "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, None),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, None))),
    ("chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]}, 400, "messages.1"),
    ("chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{1"}}]}]},
     400, "messages.1.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize("endpoint, body, status, param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, endpoint, body, status,
                                                               param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{server.url}/v1/{endpoint}", timeout=REQUEST_TIMEOUT_S,
                          headers={"content-type": "application/json"}, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    ok = server.client.completions.create(model="tiny", prompt="The", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                        "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"], "additionalProperties": False}


def test_response_format_constrains_every_choice_streamed_or_not(server):
    """json_schema (n = 3 sampled choices, each valid against the schema; streamed, the
    deltas join into the same answers) and json_object; the free-text reply of the same
    request is not JSON; /metrics counts the constrained requests and their mask time."""
    jsonschema = pytest.importorskip("jsonschema")
    import json

    before = scrape(server)
    messages = [{"role": "user", "content": "Describe a person."}]
    schema_format = {"type": "json_schema",
                     "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    settings = dict(model="tiny", messages=messages, max_tokens=60, temperature=1.0, seed=5)
    reply = server.client.chat.completions.create(n=3, response_format=schema_format,
                                                  **settings)
    answers = [c.message.content for c in reply.choices]
    for choice, answer in zip(reply.choices, answers):
        jsonschema.validate(json.loads(answer), PERSON)
        assert choice.finish_reason == "stop"
    streamed = [""] * 3
    for chunk in server.client.chat.completions.create(n=3, response_format=schema_format,
                                                       stream=True, **settings):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == answers
    anything = server.client.chat.completions.create(
        response_format={"type": "json_object"}, **settings).choices[0]
    # any object: a random model may still be writing its first key at max_tokens
    assert anything.message.content.startswith('{"')
    if anything.finish_reason == "stop":
        assert isinstance(json.loads(anything.message.content), dict)
    free = server.client.chat.completions.create(**settings).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free)
    after = scrape(server)
    assert after["llama_jax_constrained_requests_total"] - before[
        "llama_jax_constrained_requests_total"] == 7
    assert after["llama_jax_grammar_mask_seconds_total"] > before[
        "llama_jax_grammar_mask_seconds_total"]


def test_constrained_and_free_requests_arriving_at_once_each_equal_generate(server, model):
    """Seeded sampled json_schema chats and greedy free completions sent together, more than
    the slots, so requests enter rows between a constrained step's forward (which draws the
    step's noise) and its pick: each answer is `generate`'s alone with its seed, constrained
    (under the schema) or free."""
    config, params, tokenizer = model
    chats = [[{"role": "user", "content": f"Person {i}"}] for i in range(4)]
    free = [(PROMPTS[i], 6 + 5 * i) for i in range(3)]
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}

    async def chat(client, messages, seed):
        reply = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=40, temperature=0.9, seed=seed,
            response_format=schema)
        return reply.choices[0].message.content

    async def all_of_them():
        client = server.aclient()
        return await asyncio.wait_for(asyncio.gather(
            *(chat(client, m, i) for i, m in enumerate(chats)), *(client.completions.create(
                model="tiny", prompt=p, max_tokens=n, temperature=0) for p, n in free)), 180)

    answers = asyncio.run(all_of_them())
    for i, (messages, answer) in enumerate(zip(chats, answers)):
        prompt = llama2_chat(tokenizer, messages)
        (tokens,) = generate(config, params, [prompt], 40, json_schema=PERSON,
                             tokenizer=tokenizer, temperature=0.9, seed=i)
        assert answer == continuation(tokenizer, prompt, tokens)
    for (prompt, n), completion in zip(free, answers[len(chats):]):
        assert completion.choices[0].text == reference(model, tokenizer.encode(prompt), n)[2]


def test_the_client_raises_the_status_of_an_error(server):
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        server.client.completions.create(model="tiny", prompt="x", max_tokens=MAX_SEQ_LEN)


def test_a_full_queue_answers_429_and_sigterm_drains(checkpoint):
    """One slot and a queue of one: of a burst of requests while a long one decodes, one
    waits and the others are refused with Retry-After. SIGTERM then lets the requests in
    flight finish (the long one to its last token) and the process exits 0."""
    # The whole context of the model for the long request, so that the burst meets it decoding.
    context = llama_jax.load_model_config("tiny").max_seq_len
    live = Live(checkpoint, "--max-batch", "1", "--max-queue", "1", "--drain-timeout", "60",
                "--max-seq-len", str(context))
    long = {"model": "tiny", "prompt": "The", "max_tokens": context - 8, "temperature": 0,
            "stream": True, "stop": ["\u2603"]}
    clients = [httpx.Client(timeout=REQUEST_TIMEOUT_S) for _ in range(4)]
    answers = [None] * len(clients)

    def post(i):
        answers[i] = clients[i].post(f"{live.url}/v1/completions",
                                     json={"model": "tiny", "prompt": "A", "max_tokens": 4})
    try:
        with httpx.stream("POST", f"{live.url}/v1/completions", json=long,
                          timeout=REQUEST_TIMEOUT_S) as first:
            lines = first.iter_lines()
            next(lines)  # admitted and decoding
            threads = [threading.Thread(target=post, args=(i,)) for i in range(len(clients))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(REQUEST_TIMEOUT_S)
            live.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        refused = [a for a in answers if a.status_code == 429]
        assert sorted(a.status_code for a in answers) == [200, 429, 429, 429]
        assert all(a.headers["retry-after"] and a.json()["error"]["code"] ==
                   "rate_limit_exceeded" for a in refused)
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
    finally:
        for client in clients:
            client.close()
        code = live.stop()
    assert code == 0, "".join(live.lines[-30:])


# ------------------------------------------------------------------- speculative decoding

@pytest.fixture(scope="module", params=["ngram", "draft"])
def speculating(checkpoint, request):
    """A server guessing by prompt lookup or by a draft model (the model itself, whose every
    guess is kept while its cache holds the rows' contexts), every round verifying."""
    how = ["--speculate-min-accepted", "0", *(["--speculate", "ngram"] if request.param ==
                                               "ngram" else ["--draft-checkpoint",
                                                             str(checkpoint)])]
    live = Live(checkpoint, "--max-batch", str(SLOTS), "--prefill-chunk", str(CHUNK),
                "--num-speculative-tokens", "3", *how)
    live.method = request.param
    yield live
    assert live.stop() == 0, "".join(live.lines[-30:])


def repetitive(model, i: int, n: int) -> list[int]:
    """A prompt of n token ids that repeats a phrase of its own (prompt lookup finds it)."""
    rng = np.random.default_rng(100 + i)
    return (rng.integers(3, model[0].vocab_size, max(2, n // 3)).tolist() * 3)[:n]


def test_a_speculating_server_answers_as_without(speculating, model):
    """Speculating: a greedy request equals `generate` (tokens as text, log-probabilities
    within 1e-4), alone and among 16 concurrent streams of mixed lengths; streamed equals not
    streamed, several tokens a step, each with its log-probability; usage and /metrics count
    the guesses (a draft that is the model: every one kept)."""
    prompt = repetitive(model, 0, 40)
    tokens, logprobs, text = reference(model, prompt, 30)
    whole = speculating.client.completions.create(model="tiny", prompt=prompt, max_tokens=30,
                                                  temperature=0, logprobs=1)
    assert whole.choices[0].text == text
    np.testing.assert_allclose(whole.choices[0].logprobs.token_logprobs, logprobs, atol=1e-4)
    streamed = list(speculating.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=30, temperature=0, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text
    assert sum((c.choices[0].logprobs.token_logprobs for c in streamed), []) == \
        whole.choices[0].logprobs.token_logprobs
    details = whole.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    if speculating.method == "draft":
        assert details.rejected_prediction_tokens == 0
    cases = [(repetitive(model, i, 5 + 7 * i % 50), 4 + 5 * i % 40) for i in range(16)]
    before = scrape(speculating)
    for (prompt, max_tokens), text in zip(cases, concurrent_streams(speculating, cases)):
        assert text == reference(model, prompt, max_tokens)[2]
    grew = {k: v - before.get(k, 0.0) for k, v in scrape(speculating).items()}
    kept = grew["llama_jax_speculative_accepted_tokens_total"]
    drafted = grew["llama_jax_speculative_drafted_tokens_total"]
    assert 0 < kept == drafted if speculating.method == "draft" else 0 < kept <= drafted


def test_a_speculating_server_cuts_stop_strings_exactly(speculating, model):
    prompt = repetitive(model, 1, 33)
    full = reference(model, prompt, 40)[2]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    out = speculating.client.completions.create(**kwargs)
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text
              for c in speculating.client.completions.create(stream=True, **kwargs)]
    assert "".join(pieces) == out.choices[0].text


def test_a_speculating_server_decodes_under_a_grammar_as_generate_does(speculating, model):
    """A json_schema request, greedy: the speculating server's answer is `generate`'s
    constrained greedy answer on the chat prompt. Guesses were verified and kept; the draft
    (the model, guessing without the grammar) had some refused."""
    config, params, tokenizer = model
    messages = [{"role": "user", "content": '{"age": 3, "pets": ["cat"]}'}]
    prompt = llama2_chat(tokenizer, messages)
    n = MAX_SEQ_LEN - len(prompt) - 4  # a verify pass writes k + 1 positions past the end
    (tokens,) = generate(config, params, [prompt], n, json_schema=PERSON, tokenizer=tokenizer)
    reply = speculating.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=n, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert reply.choices[0].message.content == continuation(tokenizer, prompt, tokens)
    details = reply.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    if speculating.method == "draft":
        assert details.rejected_prediction_tokens > 0
