"""sample.py end to end on a tiny native checkpoint with a SentencePiece tokenizer."""

import pytest

import llama_jax
import sample
from llama_jax.decode.generate import generate, stream
from checkpoints import tiny_checkpoint_with_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint_with_tokenizer(tmp_path_factory.mktemp("ckpt") / "m")


@pytest.mark.parametrize("decode_impl", ["scan", "unrolled"])
def test_single_prompt_streams_the_greedy_continuation(checkpoint, decode_impl, capsys):
    """The default cache dtype follows the (fp32) model; both decode implementations stream
    what `generate` returns."""
    assert sample.main(["--checkpoint", str(checkpoint), "--prompt", "The cat",
                        "--temperature", "0", "--max-new-tokens", "20", "--chunk-steps", "3",
                        "--decode-impl", decode_impl]) == 0
    out, err = capsys.readouterr()
    config, params = llama_jax.load_checkpoint(checkpoint)
    tok = llama_jax.load_tokenizer(checkpoint)
    expected = generate(config, params, [tok.encode("The cat")], 20, cache_dtype="float32")[0]
    assert out == "The cat" + tok.decode(expected) + "\n"
    assert "time to first token" in err and "tokens/s" in err


def test_quantize_streams_what_the_quantized_model_generates(checkpoint, capsys, monkeypatch):
    # a tiny random model's greedy tokens may not change under int8: see what loads and decodes
    loaded, caches = [], []
    monkeypatch.setattr(sample, "load_checkpoint", lambda *a, **k: loaded.append(
        llama_jax.load_checkpoint(*a, **k)[0]) or llama_jax.load_checkpoint(*a, **k))
    monkeypatch.setattr(sample, "stream", lambda *a, **k: caches.append(
        k["cache_dtype"]) or stream(*a, **k))
    assert sample.main(["--checkpoint", str(checkpoint), "--prompt", "The cat",
                        "--temperature", "0", "--max-new-tokens", "12", "--quantize", "int8",
                        "--quantize-head", "--cache-dtype", "int8"]) == 0
    out, _ = capsys.readouterr()
    assert [(c.quantize, c.quantize_head) for c in loaded] == [("int8", True)]
    assert caches == ["int8"]
    config, params = llama_jax.load_checkpoint(checkpoint, quantize="int8", quantize_head=True)
    tok = llama_jax.load_tokenizer(checkpoint)
    expected = generate(config, params, [tok.encode("The cat")], 12, cache_dtype="int8")[0]
    assert out == "The cat" + tok.decode(expected) + "\n"


def test_the_decoder_auto_falls_back_to_is_noted(checkpoint, capsys, monkeypatch):
    """When the per-layer copy does not fit, "auto" decodes with the scan and says so."""
    from llama_jax.decode import decoder

    monkeypatch.setattr(decoder, "free_memory_bytes", lambda: 0)
    assert sample.main(["--checkpoint", str(checkpoint), "--prompt", "The cat",
                        "--temperature", "0", "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    config, params = llama_jax.load_checkpoint(checkpoint)
    tok = llama_jax.load_tokenizer(checkpoint)
    expected = generate(config, params, [tok.encode("The cat")], 6, decode_impl="scan",
                        cache_dtype="float32")[0]
    assert out == "The cat" + tok.decode(expected) + "\n"
    assert "note: decode_impl='auto': the per-layer copy of the weights and the cache need " \
        in err and "decoding with 'scan'" in err.splitlines()[0] and err.count("note:") == 1


@pytest.mark.parametrize("how", [["--speculate", "ngram", "--ngram", "1", "2"],
                                 ["--draft-checkpoint", "SELF"]])
def test_speculation_streams_the_same_greedy_continuation(checkpoint, how, capsys):
    """Prompt lookup, and the model as its own draft (every guess accepted)."""
    how = [str(checkpoint) if a == "SELF" else a for a in how]
    assert sample.main(["--checkpoint", str(checkpoint), "--prompt", "The cat sat. The cat",
                        "--temperature", "0", "--max-new-tokens", "20", "--chunk-steps", "2",
                        "--num-speculative-tokens", "3", *how]) == 0
    out, err = capsys.readouterr()
    config, params = llama_jax.load_checkpoint(checkpoint)
    tok = llama_jax.load_tokenizer(checkpoint)
    prompt = tok.encode("The cat sat. The cat")
    expected = generate(config, params, [prompt], 20, cache_dtype="float32")[0]
    assert out == "The cat sat. The cat" + tok.decode(expected) + "\n"
    accepted, drafted = map(int, err.split(" guesses accepted")[0].split(";")[-1].split(" of "))
    if "--draft-checkpoint" in how:  # (a random model's output repeats nothing to look up)
        assert accepted == drafted > 0


def test_several_prompts_and_a_prompt_file(checkpoint, tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("A dog\n\nNumbers:\n")
    assert sample.main(["--checkpoint", str(checkpoint), "--prompt", "The cat",
                        "--prompt-file", str(tmp_path / "prompts.txt"), "--seed", "3",
                        "--max-new-tokens", "8", "--attention-impl", "xla"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("--- prompt")] == [
        "--- prompt 0 ---", "--- prompt 1 ---", "--- prompt 2 ---"]


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "prompt 0 is empty"),
    (["--prompt", "x", "--top-p", "0"], "top_p=0.0 must be in"),
    (["--prompt", "x", "--temperature", "-1"], "temperature=-1.0"),
    (["--prompt-file", "/nonexistent"], "No such file"),
    ([], "no prompt"),
    (["--prompt", "x", "--attention-impl", "splash"], "attention_impl='splash' needs a TPU"),
    (["--prompt", "x", "--speculate", "ngram", "--num-speculative-tokens", "20"],
     "num_speculative_tokens=20 must be in [1, 15]"),
    (["--prompt", "x", "--speculate", "draft"], "speculate='draft' needs draft="),
])
def test_bad_input_is_one_line_and_exit_2(checkpoint, argv, message, capsys):
    assert sample.main(["--checkpoint", str(checkpoint), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


def test_json_schema_and_regex_constrain_the_streamed_output(checkpoint, tmp_path, capsys):
    """--json-schema FILE: the streamed continuation is a JSON value of the schema (what the
    library's constrained `stream` gives); --regex: a full match."""
    import json

    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999},
                                               "b": {"type": "boolean"}},
              "required": ["n", "b"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    for flags, check in ((["--json-schema", str(tmp_path / "schema.json")],
                          lambda text: set(json.loads(text)) == {"n", "b"}),
                         (["--regex", "[0-9]{3}-[a-z]{2}"],
                          lambda text: __import__("re").fullmatch("[0-9]{3}-[a-z]{2}", text))):
        assert sample.main(["--checkpoint", str(checkpoint), "--prompt", "Data:",
                            "--max-new-tokens", "60", "--seed", "1", *flags]) == 0
        out = capsys.readouterr().out
        assert out.startswith("Data:") and check(out[len("Data:"):-1]), out


@pytest.mark.parametrize("argv, message", [
    (["--json-schema", "/nonexistent.json"], "--json-schema /nonexistent.json: No such file"),
    (["--json-schema", "SCHEMA", "--regex", "a"], "give --json-schema or --regex, not both"),
    (["--json-schema", "SCHEMA"], "schema.json: json schema: Invalid type: strin"),
    (["--regex", "(ab"], "regex: "),
])
def test_bad_constraints_are_one_line_and_exit_2(checkpoint, tmp_path, argv, message, capsys):
    (tmp_path / "schema.json").write_text('{"type": "strin"}')
    argv = [str(tmp_path / "schema.json") if a == "SCHEMA" else a for a in argv]
    assert sample.main(["--checkpoint", str(checkpoint), "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_missing_checkpoint(tmp_path, capsys):
    assert sample.main(["--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "no tokenizer file" in capsys.readouterr().err


def test_chat_streams_each_answer_in_the_checkpoints_template_keeping_history(
        checkpoint, tmp_path, capsys, monkeypatch):
    """`--chat`: one user message per stdin line (blank lines skipped), each answer what
    `generate` gives for the whole conversation rendered by the checkpoint's own template."""
    import io
    import json
    import shutil

    from llama_jax.data.chat import chat_format

    chatty = tmp_path / "chatty"
    shutil.copytree(checkpoint, chatty)
    (chatty / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"), "bos_token": "<s>"}))
    monkeypatch.setattr("sys.stdin", io.StringIO("The cat\n\nand the dog\n"))
    assert sample.main(["--checkpoint", str(chatty), "--chat", "--system", "Be terse.",
                        "--temperature", "0", "--max-new-tokens", "8"]) == 0
    out, _ = capsys.readouterr()
    config, params = llama_jax.load_checkpoint(chatty)
    tok = llama_jax.load_tokenizer(chatty)
    render = chat_format(chatty, tok)
    messages, expected = [{"role": "system", "content": "Be terse."}], ""
    for line in ("The cat", "and the dog"):
        messages.append({"role": "user", "content": line})
        answer = tok.decode(generate(config, params, [render(messages)], 8)[0])
        messages.append({"role": "assistant", "content": answer})
        expected += answer + "\n"
    assert out == expected
    assert render(messages[:2])[:1] == [tok.bos_id]  # the template's BOS, as a control token
    assert sample.main(["--checkpoint", str(chatty), "--chat", "--prompt", "x"]) == 2
    assert "--chat takes its messages from stdin" in capsys.readouterr().err
    (chatty / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% if messages[0].role == 'system' %}{{ raise_exception('No system messages!') }}"
        "{% endif %}{{ messages[0].content }}")}))
    monkeypatch.setattr("sys.stdin", io.StringIO("The cat\n"))
    assert sample.main(["--checkpoint", str(chatty), "--chat", "--system", "Be terse."]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tokenizer_config.json" in err and "No system messages!" in err
