"""Tool calls (data/tool_calls.py) for each template family: Hermes/Qwen `<tool_call>` blocks,
LLaMA 3.1's JSON, and our built-in format (SmolLM2's template renders no tools). The prompt
with tools renders as transformers renders it; the calls a template writes into a
conversation read back as those calls; read piece by piece they join into the whole, for any
cut of the text; text that is not a call stays content; random-init models constrained to
the tools write calls valid under the functions' schemas (and do not without the grammar)."""

import json
import random

import pytest

import llama_jax
from llama_jax.data.chat import ChatFormat, encode_with_special_tokens
from llama_jax.data.chat_template import ChatTemplate
from llama_jax.data.tool_calls import (BUILTIN, HERMES, LLAMA3_JSON, ToolCallReader, joined,
                                       tool_format, tool_prompt)
from llama_jax.decode.grammar import call_grammar
from llama_jax.serve.chat_reply import ChatReply

jsonschema = pytest.importorskip("jsonschema")

# Qwen 2.5-style: tools in the system turn, calls in <tool_call> blocks, results as user turns
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools

Function signatures within <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each call, return a JSON object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
{%- if message.role in ['user', 'system'] or (message.role == 'assistant' and not message.tool_calls) %}\
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}{{ '<|im_start|>assistant' }}
{%- if message.content %}{{ '\n' + message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}
{%- set tool_call = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{ '}\n</tool_call>' }}
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# LLaMA 3.1-style: the tools in the first user turn, a call as {"name", "parameters"},
# results in ipython turns
LLAMA31_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}\
{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'user' and loop.first and tools %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nRespond in the format {"name": function \
name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
{%- for t in tools %}{{ t | tojson(indent=4) }}{{ '\\n\\n' }}{% endfor %}
{{- message.content + '<|eot_id|>' }}
{%- elif message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.name + \
'", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + \
'<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\
{% endif %}"""
# SmolLM2-135M-Instruct's own: ChatML, no tools
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
# each family: its template, its format, and what ends an assistant's turn
FAMILIES = {"hermes": (HERMES_TEMPLATE, HERMES, "<|im_end|>\n"),
            "llama3_json": (LLAMA31_TEMPLATE, LLAMA3_JSON, "<|eot_id|>"),
            "builtin": (SMOLLM2_TEMPLATE, BUILTIN, "<|im_end|>\n")}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -99, "maximum": 99},
            "b": {"type": "integer", "minimum": -99, "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": False}}}]
CALLS = [{"name": "get_weather", "arguments": {"city": "Zürich \"Nord\"", "unit": "celsius"}},
         {"name": "add", "arguments": {"a": 2, "b": -3}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich, and 2 + -3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": CALLS[0]}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"},
    {"role": "assistant", "content": "21 degrees."},
    {"role": "user", "content": "Thanks"}]


def template(family: str) -> ChatTemplate:
    return ChatTemplate(family, FAMILIES[family][0], "<|begin_of_text|>", "<|eot_id|>")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_template_family_is_read_as_its_tool_format(family):
    assert tool_format(FAMILIES[family][0]) is FAMILIES[family][1]
    assert tool_format(None) is BUILTIN


@pytest.mark.parametrize("family", ["hermes", "llama3_json"])
def test_a_template_with_tools_renders_as_transformers_renders_it(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    from test_chat_template import checkpoint
    reference = transformers.AutoTokenizer.from_pretrained(
        checkpoint(tmp_path / family, FAMILIES[family][0], bos_token="<|begin_of_text|>"))
    messages, extra = tool_prompt(FAMILIES[family][1], CONVERSATION, TOOLS)
    ours = template(family).render(messages, **extra)
    assert ours == reference.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False,
                                                 add_generation_prompt=True)
    assert '"name": "get_weather"' in ours


def test_the_builtin_format_tells_the_model_the_tools_and_gives_back_results():
    """A template without tools (SmolLM2's): the tools in our system message (after the
    conversation's own), an assistant's calls as their text, results as user turns."""
    messages, extra = tool_prompt(BUILTIN, CONVERSATION, TOOLS)
    assert extra == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user",
                                             "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n")
    for tool in TOOLS:
        assert json.dumps(tool["function"], ensure_ascii=False) in messages[0]["content"]
    assert messages[2]["content"] == BUILTIN.call_text([CALLS[0]])
    assert messages[3]["content"] == "<tool_response>\n{\"temperature\": 21}\n</tool_response>"
    text = template("builtin").render(messages)
    assert "<|im_start|>system\nBe brief." in text  # the template's default system: replaced


def rendered(family: str, messages: list[dict], generation_prompt: bool) -> str:
    plain, extra = tool_prompt(FAMILIES[family][1], messages, TOOLS)
    return template(family).render(plain, add_generation_prompt=generation_prompt, **extra)


@pytest.mark.parametrize("family", FAMILIES)
def test_calls_a_template_writes_read_back_as_those_calls(family):
    """The assistant turn a template writes for tool calls, read by the family's reader,
    gives back those calls: we read the format the model was trained to write."""
    text_of, form, end = FAMILIES[family]
    calls = CALLS[:1] if family == "llama3_json" else CALLS  # its template writes one
    asked = CONVERSATION[:2]
    answered = asked + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": c} for i, c in enumerate(calls)]}]
    before, after = rendered(family, asked, True), rendered(family, answered, False)
    assert after.startswith(before) and after.endswith(end)
    reader = ToolCallReader(form)
    content, read = joined(reader.push(after[len(before):-len(end)]) + reader.finish())
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in read] == [
        (c["name"], c["arguments"]) for c in calls]


ANSWERS = [  # (format, text, content, [(name, arguments text)])
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "P, '
     '\\"FR\\"", "n": [1, {"a": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "add", '
     '"arguments": {}}\n</tool_call>\n', "Let me look.",
     [("get_weather", '{"city": "P, \\"FR\\"", "n": [1, {"a": "}"}]}'), ("add", "{}")]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"s": "a \\"}\\" b\\\\"}}\n</tool_call>',
     None, [("f", '{"s": "a \\"}\\" b\\\\"}')]),
    (HERMES, "Just text <tool_ and more.  ", "Just text <tool_ and more.  ", []),
    (HERMES, "<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call>"
     " after", []),
    (HERMES, '<tool_call>{"name": "add", "arguments": {"a": 1', None, [("add", '{"a": 1')]),
    (LLAMA3_JSON, ' {"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": '
     '{"y": "z"}}', None, [("f", '{"x": 1}'), ("g", '{"y": "z"}')]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "f", "arguments": {"x": 1}}', None, [("f", '{"x": 1}')]),
    (LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', []),
    (LLAMA3_JSON, 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),
    (BUILTIN, '<tool_call>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": '
     '{"y": [2]}}]</tool_call>', None, [("f", '{"x": 1}'), ("g", '{"y": [2]}')]),
    (BUILTIN, "I can't. <tool_call>[1, 2]</tool_call>", "I can't. <tool_call>[1, 2]</tool_call>",
     []),
]


@pytest.mark.parametrize("form, text, content, calls", ANSWERS)
def test_answers_read_into_content_and_calls_whole_or_piece_by_piece(form, text, content,
                                                                     calls):
    """The whole text at once gives the expected content and calls; any cut into pieces
    gives deltas that join into the same (the stream equals the response)."""
    reader = ToolCallReader(form)
    whole = joined(reader.push(text) + reader.finish())
    assert whole[0] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole[1]] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in whole[1])
    for seed in range(12):
        rng, reader, deltas, at = random.Random(seed), ToolCallReader(form), [], 0
        while at < len(text):
            step = rng.randint(1, 6)
            deltas += reader.push(text[at:at + step])
            at += step
        pieces = joined(deltas + reader.finish())
        assert pieces[0] == whole[0]
        assert [c["function"] for c in pieces[1]] == [c["function"] for c in whole[1]]


def test_a_replys_openai_deltas_join_into_its_message():
    """The server's deltas (serve/chat_reply.py): content, then each call's head (index, id,
    name) and its arguments in pieces, joined by index as OpenAI's clients join them."""
    text = ANSWERS[0][1]
    whole = ChatReply(HERMES).message(text)
    for seed in range(6):  # seed 0: the whole text at once
        rng, reply, deltas, at = random.Random(seed), ChatReply(HERMES), [], 0
        while at < len(text):
            step = rng.randint(1, 30) if seed else len(text)
            deltas += reply.deltas(text[at:at + step], last=at + step >= len(text))
            at += step
        content, calls = "", []
        for delta in deltas:
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(calls)
                    calls.append({"id": call["id"], "type": call["type"], "function": {
                        "name": call["function"]["name"], "arguments": ""}})
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        assert content == whole["content"]
        assert [c["function"] for c in calls] == [c["function"] for c in whole["tool_calls"]]
    assert reply.finish_reason("stop") == "tool_calls"
    assert reply.finish_reason("length") == "length"
    assert ChatReply(None).finish_reason("stop") == "stop"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from test_grammar import random_model
    return random_model("byte_level", tmp_path_factory)


@pytest.mark.parametrize("form", [HERMES, LLAMA3_JSON, BUILTIN], ids=lambda f: f.name)
def test_random_models_constrained_to_the_tools_write_valid_calls_and_not_without(model, form):
    """tool_choice "required" (calls of any tool, several allowed) and a named function (one
    call of it): every answer reads as calls of the tools, arguments valid under their
    schemas; unconstrained, the same model writes no call."""
    config, params, tokenizer = model
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    prompts = [tokenizer.encode(p) for p in ("Weather?", "Sum", "call")]
    grammars = [call_grammar(form, TOOLS), call_grammar(form, TOOLS, "add", parallel=False),
                call_grammar(form, TOOLS, "get_weather")]
    out = llama_jax.generate(config, params, prompts, 120, temperature=1.0, seed=1,
                             grammar=grammars, tokenizer=tokenizer)
    for row, (tokens, only) in enumerate(zip(out, [None, "add", "get_weather"])):
        reader, text = ToolCallReader(form), tokenizer.decode(tokens)
        content, calls = joined(reader.push(text) + reader.finish())
        assert calls and content is None, text
        assert len(calls) == 1 or row == 0, text
        complete = calls if len(tokens) < 120 else calls[:-1]  # the last may be cut short
        for call in complete:
            name = call["function"]["name"]
            assert name == only or only is None and name in schemas
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
    free = llama_jax.generate(config, params, prompts, 120, temperature=1.0, seed=1)
    for row in free:
        reader = ToolCallReader(form)
        assert not joined(reader.push(tokenizer.decode(row)) + reader.finish())[1]


def test_a_format_for_auto_with_a_response_format_is_calls_or_that_json(model):
    """tool_choice "auto" with a response_format: a call, or JSON of the schema."""
    config, params, tokenizer = model
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    grammar = call_grammar(HERMES, TOOLS, content_schema=schema)
    out = llama_jax.generate(config, params, [tokenizer.encode(str(i)) for i in range(4)], 120,
                             temperature=1.0, seed=3, grammar=grammar, tokenizer=tokenizer)
    for text in [tokenizer.decode(r) for r in out]:
        reader = ToolCallReader(HERMES)
        content, calls = joined(reader.push(text) + reader.finish())
        if not calls:
            jsonschema.validate(json.loads(content), schema)


def test_a_chat_format_renders_tools_through_its_template():
    """`ChatFormat(messages, tools)`: the template's own rendering of the tools."""
    class Characters:  # a tokenizer of one id per character, no control tokens
        special_tokens: dict = {}

        def encode(self, text, bos=False):
            return [ord(c) for c in text]

    hermes = ChatFormat(lambda m, extra: encode_with_special_tokens(
        Characters(), template("hermes").render(m, **extra)), HERMES)
    ids = hermes(CONVERSATION[:2], TOOLS)
    assert "".join(map(chr, ids)) == template("hermes").render(CONVERSATION[:2], tools=TOOLS)
