"""Tool calling through the live server (OpenAI's `tools`, `tool_choice`, `tool` messages),
talked to with the real `openai` client: a checkpoint whose chat template writes Hermes-style
`<tool_call>` blocks, random weights. Calls forced by "required" or a named function are calls
of the tools with arguments valid under their schemas; streamed, the tool-call deltas join
into the response; "auto" and "none" answer as the model chose; `tool` messages go through the
template; /metrics counts the choices that made calls."""

import json

import pytest

import llama_jax
from llama_jax.data.chat import chat_format
from test_serve import Live, scrape, tiny_checkpoint_with_tokenizer

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

# The tools by name, the messages, and each call as `<tool_call>{"name", "arguments"}`
TEMPLATE = ("{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}"
            "{% endfor %}\n{% endif %}{% for m in messages %}<|{{ m.role }}|>"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, "
            "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
            "{{ m.content }}\n{% endfor %}<|assistant|>")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Adds",
                                           "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tiny_checkpoint_with_tokenizer(tmp_path_factory.mktemp("tools") / "m")
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def server(checkpoint):
    live = Live(checkpoint, "--max-batch", "4", "--max-seq-len", "256")
    yield live
    assert live.stop() == 0, "".join(live.lines[-30:])


def streamed(chunks) -> dict[int, dict]:
    """Each choice of a streamed response, its deltas joined: content, tool calls (with each
    call's id, type and name in its first delta), finish reason."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            joined = out.setdefault(choice.index, {"content": "", "calls": [], "finish": None})
            joined["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index == len(joined["calls"]):  # a new call: its head comes first
                    assert call.id and call.type == "function" and call.function.name
                    joined["calls"].append([call.function.name, ""])
                joined["calls"][call.index][1] += call.function.arguments or ""
            joined["finish"] = choice.finish_reason or joined["finish"]
    return out


def calls_of(message) -> list[list[str]]:
    return [[c.function.name, c.function.arguments] for c in message.tool_calls or []]


def test_required_and_named_tool_choices_make_valid_calls_streamed_or_not(server):
    before = scrape(server)
    settings = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, temperature=1.0,
                    seed=3, parallel_tool_calls=False)  # a random model may call forever
    for choice_of_tool, n in (("required", 3),
                              ({"type": "function", "function": {"name": "add"}}, 2)):
        reply = server.client.chat.completions.create(n=n, tool_choice=choice_of_tool,
                                                      **settings)
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert len(choice.message.tool_calls) == 1
            assert choice.message.tool_calls[0].id.startswith("call_")
            for name, arguments in calls_of(choice.message):
                assert choice_of_tool == "required" or name == "add"
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        stream = streamed(server.client.chat.completions.create(
            n=n, tool_choice=choice_of_tool, stream=True, **settings))
        assert [stream[i]["calls"] for i in range(n)] == [calls_of(c.message)
                                                          for c in reply.choices]
        assert all(stream[i]["finish"] == "tool_calls" and not stream[i]["content"]
                   for i in range(n))
    after = scrape(server)
    key = "llama_jax_choices_total{tool_calls}"
    assert after[key] - before.get(key, 0) == 10


def test_auto_and_none_answer_as_the_model_chose_streamed_or_not(server):
    """Unconstrained: whatever the model wrote, read for calls under "auto" (a random model
    writes none: its text is the content) and never under "none"."""
    for choice_of_tool in ("auto", "none"):
        settings = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice_of_tool,
                        max_tokens=30, temperature=1.0, seed=11)
        reply = server.client.chat.completions.create(**settings).choices[0]
        assert reply.message.content and not reply.message.tool_calls
        assert reply.finish_reason in ("stop", "length")
        stream = streamed(server.client.chat.completions.create(stream=True, **settings))[0]
        assert stream["content"] == reply.message.content and not stream["calls"]


def test_tool_messages_go_back_through_the_template(server, checkpoint):
    """An assistant's call and the tool's result: the prompt is the template's rendering of
    them (its length in usage), and a forced call of the answer follows."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
        {"role": "user", "content": "Add 2."}]
    reply = server.client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=60, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "add"}})
    tokenizer = llama_jax.load_tokenizer(checkpoint)
    expected = chat_format(checkpoint, tokenizer)(
        [{**m, "content": m["content"] or ""} for m in messages[:1]] + [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}, messages[3]],
        TOOLS)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in (
        tokenizer.decode(expected))
    assert reply.usage.prompt_tokens == len(expected)
    (name, arguments), = calls_of(reply.choices[0].message)
    assert name == "add"
    jsonschema.validate(json.loads(arguments), ADD)


def test_a_tool_schema_that_does_not_compile_is_refused_naming_the_tool(server):
    bad = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}
    with pytest.raises(openai.BadRequestError, match=r"tools\[2\].function.parameters "
                                                     r"\(function 'broken'\).*strin") as e:
        server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                              tools=TOOLS + [bad])
    assert e.value.param == "tools[2].function.parameters"

