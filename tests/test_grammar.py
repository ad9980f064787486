"""Constrained decoding (decode/grammar.py): random-init models write schema-valid JSON for
every seed with the grammar (and do not without it), over a SentencePiece vocabulary with byte
fallback, a byte-level BPE one and LLaMA 3's tiktoken one; rows with different grammars and rows without one share a
batch (an unconstrained row decodes as it does alone); constrained greedy decoding is the
reference loop (the model over the whole prefix each step, float64 masked argmax); regexes
and Lark grammars hold; bad schemas and arguments are refused naming them."""

import dataclasses
import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax.decode.generate import GenerationStats
from llama_jax.decode.grammar import Grammar, Matcher, vocabulary
from llama_jax.errors import GenerateError

from checkpoints import stdlib_tokenizer
from models import TINY, random_params

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    "where": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50,
                                                     "maximum": 50}},
              "required": ["x"], "additionalProperties": False}},
    "required": ["name", "count", "ok", "tags", "where"], "additionalProperties": False}
OTHER = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
         "minItems": 1, "maxItems": 4}


@pytest.fixture(scope="module", params=["sentencepiece", "byte_level"])
def model(request, tmp_path_factory):
    """A random-init model over a real vocabulary, and its tokenizer."""
    return random_model(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["sentencepiece", "byte_level", "tiktoken"])
def any_model(request, tmp_path_factory):
    """`model`, and one over LLaMA 3's 128K tiktoken vocabulary (sampling over it is slow on
    the CPU: it takes the greedy tests only)."""
    return random_model(request.param, tmp_path_factory)


def random_model(vocabulary: str, tmp_path_factory):
    directory = tmp_path_factory.mktemp(vocabulary)
    if vocabulary == "sentencepiece":  # byte fallback: any text, byte by byte
        (directory / "tokenizer.model").write_bytes(stdlib_tokenizer()[0])
    elif vocabulary == "tiktoken":  # LLaMA 3's 128K-token file
        llama_models = pytest.importorskip("llama_models")
        directory = Path(llama_models.__file__).parent / "llama3"
    else:
        test_json_tokenizer = pytest.importorskip("test_json_tokenizer")
        test_json_tokenizer.save(test_json_tokenizer.byte_level(), directory / "tok",
                                 {"eos_token": "<|endoftext|>"})
        directory = directory / "tok"
    tokenizer = llama_jax.load_tokenizer(directory)
    config = dataclasses.replace(TINY, vocab_size=tokenizer.vocab_size + 8,  # padded rows
                                 eos_ids=tokenizer.eos_ids)
    return config, random_params({"m": config})["m"], tokenizer


def texts(tokenizer, rows) -> list[str]:
    return [tokenizer.decode(r) for r in rows]


def test_random_models_write_schema_valid_json_greedy_with_the_grammar_only(any_model):
    check_schema_valid_with_the_grammar_only(any_model, 0.0, seeds=1)  # greedy: seeds alike


def test_random_models_write_schema_valid_json_sampled_with_the_grammar_only(model):
    check_schema_valid_with_the_grammar_only(model, 1.0, seeds=2)


def check_schema_valid_with_the_grammar_only(model, temperature: float, seeds: int):
    config, params, tokenizer = model
    prompts = [tokenizer.encode(p) for p in ("Answer:", "x", "JSON please")]
    for seed in range(seeds):
        out = llama_jax.generate(config, params, prompts, 160, temperature=temperature,
                                 seed=seed, json_schema=SCHEMA, tokenizer=tokenizer)
        for text in texts(tokenizer, out):
            jsonschema.validate(json.loads(text), SCHEMA)
        free = llama_jax.generate(config, params, prompts, 160, temperature=temperature,
                                  seed=seed)
        for text in texts(tokenizer, free):  # the grammar, not luck, made them valid
            with pytest.raises(ValueError):
                json.loads(text)


def test_rows_of_other_grammars_and_none_share_a_batch(model):
    """A row of each schema, a regex and a Lark grammar, and an unconstrained one: each holds,
    and the unconstrained row is what it generates alone (rows never mix)."""
    config, params, tokenizer = model
    prompts = [tokenizer.encode(p) for p in ("a", "b", "c", "d", "e")]
    lark = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,3}/'
    grammars = [Grammar.json_schema(SCHEMA), Grammar.json_schema(OTHER),
                Grammar.regex(r"[a-z]{3}-[0-9]{2}"), Grammar.lark(lark), None]
    out = llama_jax.generate(config, params, prompts, 160, temperature=1.0, seed=4,
                             grammar=grammars, tokenizer=tokenizer)
    written = texts(tokenizer, out)
    jsonschema.validate(json.loads(written[0]), SCHEMA)
    jsonschema.validate(json.loads(written[1]), OTHER)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", written[2]), written[2]
    assert re.fullmatch(r"yes|no|maybe [0-9]{1,3}", written[3]), written[3]
    alone = llama_jax.generate(config, params, prompts, 160, temperature=1.0, seed=4)
    assert out[4] == alone[4]


def test_constrained_greedy_is_the_masked_argmax_of_the_model_over_the_prefix(any_model):
    """The reference path: each step the model over the whole sequence so far (no cache),
    float64 logits, the argmax among the tokens the grammar allows (stop ids where it has
    ended): the same tokens as the cached, jitted constrained decoder."""
    config, params, tokenizer = any_model
    prompt = tokenizer.encode("The answer is")
    (ours,) = llama_jax.generate(config, params, [prompt], 40, json_schema=OTHER,
                                 tokenizer=tokenizer)
    matcher = Matcher(Grammar.json_schema(OTHER),
                      vocabulary(tokenizer, config.vocab_size, config.stop_ids))
    tokens = []
    for _ in range(40):
        logits_V = np.asarray(llama_jax.forward(config, params, jnp.asarray([prompt + tokens])),
                              np.float64)[0, -1]
        words = np.zeros(-(-config.vocab_size // 32), np.int32)
        matcher.fill(words)
        allowed_V = (words[np.arange(config.vocab_size) // 32]
                     >> (np.arange(config.vocab_size) % 32)) & 1
        token = int(np.argmax(np.where(allowed_V == 1, logits_V, -np.inf)))
        if token in config.stop_ids:
            break
        tokens.append(token)
        matcher.accept(token)
    assert ours == tokens and json.loads(tokenizer.decode(tokens))


def test_a_matcher_s_copy_goes_its_own_way_from_the_same_place(model):
    """A server copies one checked matcher per request: the copy masks as a new matcher of
    the grammar does, token after token, and the matcher it came from stays where it was."""
    config, _, tokenizer = model
    vocab = vocabulary(tokenizer, config.vocab_size, config.stop_ids)
    W = -(-config.vocab_size // 32)

    def mask(matcher):
        words = np.zeros(W, np.int32)
        matcher.fill(words)
        return words

    start = Matcher(Grammar.json_schema(OTHER), vocab)
    at_start = mask(start)
    copy, new = start.copy(), Matcher(Grammar.json_schema(OTHER), vocab)
    rng = np.random.default_rng(0)
    for _ in range(12):
        words = mask(new)
        assert np.array_equal(mask(copy), words)
        allowed = [t for t in range(config.vocab_size) if new.allows(words, t)]
        token = int(rng.choice(allowed))
        copy.accept(token)
        new.accept(token)
    assert not np.array_equal(mask(copy), at_start)
    assert np.array_equal(mask(start), at_start)


def test_speculation_under_a_grammar_keeps_constrained_greedy_and_valid_samples(model, request):
    """Guesses (prompt lookup's from a prompt of JSON; a draft model's, here the model itself,
    drawn without the grammar) verified among the tokens the grammar allows: greedy output is
    plain constrained greedy's, guesses were kept (and some the grammar forbids were not),
    and sampled output holds the schema. A draft on the SentencePiece vocabulary, prompt
    lookup on the byte-level one: each way and each vocabulary once."""
    vocabulary = request.node.callspec.params["model"]
    method = {"sentencepiece": "draft", "byte_level": "ngram"}[vocabulary]
    config, params, tokenizer = model
    example = json.dumps({"name": "ab", "count": 7, "ok": True, "tags": ["red"],
                          "where": {"x": 3}})
    prompts = [tokenizer.encode(f"{example}\n{example}\n"), tokenizer.encode("x")]
    settings = dict(json_schema=SCHEMA, tokenizer=tokenizer)
    speculation = ({"speculate": "ngram", "min_accepted": 0.0} if method == "ngram" else
                   {"draft": (config, params)})
    plain = llama_jax.generate(config, params, prompts, 80, **settings)
    stats = GenerationStats()
    assert llama_jax.generate(config, params, prompts, 80, stats=stats, **speculation,
                              **settings) == plain
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    for seed in range(2):
        for row in llama_jax.generate(config, params, prompts, 160, temperature=1.0,
                                      seed=seed, **speculation, **settings):
            jsonschema.validate(json.loads(tokenizer.decode(row)), SCHEMA)


def test_bad_grammars_and_arguments_are_refused_naming_them(model):
    config, params, tokenizer = model
    generate = llama_jax.generate
    prompts = [tokenizer.encode("x")]
    for kwargs, message in (
            ({"json_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
             "json schema: .*strin"),
            ({"json_schema": "{not json"}, "json schema: not JSON"),
            ({"regex": "(ab"}, "regex: .*unclosed group"),
            ({"grammar": "start: undefined_rule"}, "grammar: .*undefined_rule"),
            ({"json_schema": SCHEMA, "regex": "a"}, "one of grammar, json_schema and regex"),
            ({"json_schema": [SCHEMA, SCHEMA]}, "2 values of json_schema for 1 prompts")):
        with pytest.raises(GenerateError, match=message):
            generate(config, params, prompts, 8, tokenizer=tokenizer, **kwargs)
    with pytest.raises(GenerateError, match="needs the tokenizer"):
        generate(config, params, prompts, 8, json_schema=SCHEMA)


def test_a_model_without_stop_ids_ends_constrained_rows_at_the_tokenizers_eos(model):
    """A grammar's end must end its row: without the model's stop ids (the demo model has
    none), the tokenizer's end of sequence ends the batch's rows."""
    config, params, tokenizer = model
    bare = dataclasses.replace(config, eos_ids=())
    prompts = [tokenizer.encode("x"), tokenizer.encode("y")]
    out = llama_jax.generate(bare, params, prompts, 80, json_schema=[OTHER, None],
                             tokenizer=tokenizer)
    jsonschema.validate(json.loads(tokenizer.decode(out[0])), OTHER)
    assert len(out[0]) < 80
