"""A checkpoint's own chat template, rendered exactly as transformers' `apply_chat_template`
renders it (tokenize=False) for templates of several families, from each place a checkpoint
keeps one; broken and refusing templates reported naming the file."""

from __future__ import annotations

import json

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from llama_jax import load_chat_template  # noqa: E402
from llama_jax.errors import CheckpointError, GenerateError  # noqa: E402

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# LLaMA-3.1-style: a date from strftime_now, tools as JSON, loop controls, trimmed blocks
LLAMA31 = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
# Zephyr's: one statement per line, indented, no whitespace control (trim_blocks, lstrip_blocks)
ZEPHYR = """{% for message in messages %}
    {% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
    {% endif %}
    {% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
    {% endif %}
{% endfor %}"""
# training markers and a refusal
MARKED = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
          "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
          "{% if m.role == 'assistant' %}{% generation %}{{ m.content + eos_token }}"
          "{% endgeneration %}{% else %}[INST] {{ m.content }} [/INST]{% endif %}{% endfor %}")

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Grüße! What is 2+2?  "},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 日本?"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Wetter für",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def checkpoint(directory, template, **settings):
    """A directory transformers' AutoTokenizer loads: a tiny tokenizer.json and the template
    in tokenizer_config.json (or in chat_template.jinja when `template` is a path name)."""
    directory.mkdir()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2},
                                                           unk_token="<unk>"))
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", **settings}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("family, template, messages, extra", [
    ("chatml", CHATML, MESSAGES[1:], {}),
    ("zephyr", ZEPHYR, MESSAGES, {}),
    ("llama31", LLAMA31, MESSAGES, {"tools": TOOLS}),
    ("llama31-no-tools", LLAMA31, MESSAGES, {}),
    ("marked", MARKED, MESSAGES[1:], {}),
])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_templates_render_as_transformers_renders_them(tmp_path, family, template, messages,
                                                       extra, generation_prompt):
    directory = checkpoint(tmp_path / family, template)
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    expected = reference.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt, **extra)
    ours = load_chat_template(directory).render(messages, generation_prompt, **extra)
    assert ours == expected


def test_where_a_checkpoint_keeps_its_template(tmp_path):
    named = checkpoint(tmp_path / "named", [{"name": "default", "template": CHATML},
                                            {"name": "tool_use", "template": LLAMA31}])
    assert load_chat_template(named).text == CHATML
    assert load_chat_template(named, "tool_use").text == LLAMA31
    with pytest.raises(CheckpointError, match="no template named 'rag'"):
        load_chat_template(named, "rag")
    jinja = checkpoint(tmp_path / "jinja", None)
    assert load_chat_template(jinja) is None  # none: the server's built-in formats apply
    (jinja / "chat_template.jinja").write_text(CHATML)
    assert load_chat_template(jinja).source.endswith("chat_template.jinja")
    assert load_chat_template(jinja).render(MESSAGES[1:2]) == transformers.AutoTokenizer \
        .from_pretrained(jinja).apply_chat_template(MESSAGES[1:2], tokenize=False,
                                                   add_generation_prompt=True)
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["<unk>", "<|im_start|>", "<|im_end|>"])
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    template = load_chat_template(path)
    assert (template.text, template.eos_token) == (CHATML, "<|im_end|>")


def test_broken_and_refusing_templates_name_the_file(tmp_path):
    broken = checkpoint(tmp_path / "broken", "{% for m in messages %}{{ m.content }")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not a valid chat template"):
        load_chat_template(broken)
    marked = load_chat_template(checkpoint(tmp_path / "marked", MARKED))
    with pytest.raises(GenerateError, match="tokenizer_config.json: the chat template refused "
                                            "the messages: Only user and assistant roles"):
        marked.render(MESSAGES)
