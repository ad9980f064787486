"""The serving engine in-process: continuous batching equals `generate` alone for every mixer
and cache (GQA, MLA's latent cache, MoE with a capacity factor, int8, both layouts) while rows
come and go and the cache grows and shrinks; a failing program fails only its requests; and the
text and chat-format pieces against references (Meta's LLaMA 3 chat format). The KV cache's
pages: more rows than a dense cache of the same bytes, preemption when they run short."""

import dataclasses
import functools
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax.decode.generate import generate
from llama_jax.errors import GenerateError
from llama_jax.model.kv_cache import copied_pages, init_paged_cache
from llama_jax.data.chat import (chat_format, encode_with_special_tokens, llama2_chat,
                                  llama3_chat)
from llama_jax.serve.engine import Engine
from llama_jax.serve.requests import Request
from llama_jax.serve.text import StopText
from engine_runs import run
from models import SERVING, TINY, prompts, random_params

CONFIGS = SERVING
LENGTHS = [3, 17, 40, 9, 25, 5, 33]
NEW = [10, 30, 7, 38, 20, 12, 3]


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIGS)


@pytest.mark.parametrize("name, cache_dtype, decode_impl", [
    ("gqa", "int8", "scan"), ("mla", "int8", "unrolled"), ("moe", None, "unrolled")])
def test_continuous_batching_equals_generate_alone(params, name, cache_dtype, decode_impl):
    """7 requests through 3 rows (3 steps per dispatch): each one's greedy tokens and
    log-probabilities equal `generate` alone."""
    config, p = CONFIGS[name], params[name]
    engine = Engine(config, p, max_batch=3, max_seq_len=80, stop_ids=[],
                    cache_dtype=cache_dtype, decode_impl=decode_impl, steps_per_dispatch=3)
    engine.start()
    try:
        batch = prompts(LENGTHS, vocab=config.vocab_size)
        results = run(engine, [dict(prompt=q, max_tokens=n) for q, n in zip(batch, NEW)])
    finally:
        assert engine.stop(30)
    # One ragged batch (each row generates what it would alone: test_generate.py), cut to
    # each request's length: greedy tokens never depend on how many follow.
    tokens, logprobs = generate(config, p, batch, max(NEW), stop_tokens=[],
                                cache_dtype=cache_dtype, decode_impl=decode_impl,
                                return_logprobs=True)
    for n, result, row, row_logprobs in zip(NEW, results, tokens, logprobs):
        assert result["tokens"] == row[:n] and result["reason"] == "length"
        np.testing.assert_allclose(result["logprobs"], row_logprobs[:n], atol=1e-4)


@pytest.mark.parametrize("decode_impl", ["scan", "unrolled"])
def test_the_table_widens_for_a_long_row_and_narrows_after_it(params, decode_impl,
                                                              monkeypatch):
    """Two short requests decode while a 150-token prompt arrives: the programs attend over
    64 positions, then 256 to hold it, and 64 again once it has ended and the short rows
    need no more. Then a row alone reaches past 64 as it decodes: the table widens before
    the dispatch that would write there. Every request's tokens equal `generate` alone, at
    every width."""
    config, p = CONFIGS["gqa"], params["gqa"]
    engine = Engine(config, p, max_batch=3, max_seq_len=256, stop_ids=[],
                    decode_impl=decode_impl, steps_per_dispatch=2)
    widths = []
    decode = engine.programs.decode
    monkeypatch.setattr(engine.programs, "decode", lambda *args, **kw: (
        widths.append(engine.width * engine.shape.page_size), decode(*args, **kw))[1])
    engine.start()
    batch = prompts([5, 150, 8, 58], seed=21, vocab=config.vocab_size)
    new = [50, 10, 50, 12]
    try:
        results = run(engine, [dict(prompt=q, max_tokens=n) for q, n in zip(batch[:3], new)])
        assert widths[0] == 64 and max(widths) == 256 and widths[-1] == 64, widths
        results += run(engine, [dict(prompt=batch[3], max_tokens=new[3])])
        assert widths[-1] == 128, widths
    finally:
        assert engine.stop(30)
    for prompt, n, result in zip(batch, new, results):
        tokens, logprobs = generate(config, p, [prompt], n, stop_tokens=[],
                                    decode_impl=decode_impl, return_logprobs=True)
        assert result["tokens"] == tokens[0]
        np.testing.assert_allclose(result["logprobs"], logprobs[0], atol=1e-4)


def test_pages_run_more_rows_and_preempt_the_newest_when_short(params, monkeypatch):
    """A pool of 8 pages of 16 positions: a dense cache of its bytes holds one row of the
    96-token context, and here three or four rows decode at once. As they grow the pool runs
    short: the newest row is preempted, its request decoded anew later. Every request's
    sampled tokens still equal `generate` alone with its seed, and every page is free once
    the engine is idle. (The unrolled decoder: both read pages alike, test_paged_cache.py.)"""
    decode_impl = "unrolled"
    from llama_jax.decode.decoder import page_bytes

    config, p = CONFIGS["gqa"], params["gqa"]
    each = page_bytes(config, p, 16, "float32", None)
    engine = Engine(config, p, max_batch=4, max_seq_len=96, stop_ids=[], cache_dtype="float32",
                    decode_impl=decode_impl, steps_per_dispatch=3, kv_cache_bytes=8 * each)
    assert engine.shape.n_pages == 8
    running = []
    decode = engine.programs.decode
    monkeypatch.setattr(engine.programs, "decode", lambda *args, **kw: (
        running.append(sum(engine._decoding(b) for b in range(4))), decode(*args, **kw))[1])
    engine.start()
    batch = prompts([30, 17, 40, 9, 25, 5, 33], seed=4, vocab=config.vocab_size)
    new = [60, 50, 40, 38, 20, 12, 30]
    try:
        results = run(engine, [dict(prompt=q, max_tokens=n, temperature=0.8, seed=i)
                               for i, (q, n) in enumerate(zip(batch, new))])
    finally:
        assert engine.stop(30)
    stats = engine.stats()
    assert max(running) >= 3 and stats["preemptions"] > 0, (running, stats)
    # Four choices of a 95-token prompt: its 6 pages and a last page each for three more.
    group = [Request(prompt=batch[0] * 3 + batch[1][:5], max_tokens=1, deliver=print)] * 4
    with pytest.raises(GenerateError, match="need 9 pages of the KV cache's 8"):
        engine.submit_group(group)
    assert stats["kv_pages_used"] == 0 and stats["finished"] == {"length": 7}
    for i, (q, n, result) in enumerate(zip(batch, new, results)):
        expected = generate(config, p, [q], n, stop_tokens=[], cache_dtype="float32",
                            decode_impl=decode_impl, temperature=0.8, seed=i)[0]
        assert result["tokens"] == expected


def test_an_engine_reserves_its_largest_cache_before_choosing_the_decoder(monkeypatch):
    """"auto" decodes unrolled only while the per-layer copy and the rows' largest cache fit
    in the free memory (on CPU here; the same rule on GPU)."""
    from llama_jax.decode import decoder
    from llama_jax.plan.costs import SERVING_PAGE_SIZE, kv_cache_bytes_per_token
    from llama_jax.plan.serving import ServerShape

    p = llama_jax.init_params(TINY, jax.random.key(9))  # no copy of it made yet
    need = (sum(w.nbytes for w in jax.tree.leaves(p["groups"]))
            + ServerShape.of(TINY.max_seq_len,
                             SERVING_PAGE_SIZE * kv_cache_bytes_per_token(TINY, "float32"),
                             max_batch=2, max_seq_len=64).rows_bytes)
    for free, layout in ((need - 1, "stacked"), (need, "per_layer")):  # no copy, then one
        monkeypatch.setattr(decoder, "free_memory_bytes", lambda: free)
        engine = Engine(TINY, p, max_batch=2, max_seq_len=64, cache_dtype="float32",
                        steps_per_dispatch=4)
        assert engine.layout == layout


def test_an_engine_on_a_mesh_equals_generate_unsharded(params, tmp_path):
    """Parameters split over data·fsdp·tensor = 2·2·2 devices: the rows are laid out by the
    cache rules and the tokens are those of the unsharded `generate`."""
    from llama_jax.config import MeshConfig
    from llama_jax.parallel import sharding

    config = CONFIGS["gqa"]
    llama_jax.save_native(config, params["gqa"], tmp_path)
    rules = MeshConfig(data=2, fsdp=2, tensor=2)
    _, placed = llama_jax.load_checkpoint(tmp_path, mesh=sharding.make_mesh(rules),
                                          mesh_config=rules)
    engine = Engine(config, placed, max_batch=4, max_seq_len=64, stop_ids=[],
                    steps_per_dispatch=4, mesh_config=rules)
    engine.start()
    try:
        batch = prompts([5, 12, 3, 9, 20], seed=3, vocab=config.vocab_size)
        results = run(engine, [dict(prompt=q, max_tokens=9) for q in batch])
    finally:
        assert engine.stop(30)
    assert len(jax.tree.leaves(engine.programs.rows.cache.groups)[0].sharding.device_set) == 8
    expected = generate(config, params["gqa"], batch, 9, stop_tokens=[])
    assert [r["tokens"] for r in results] == expected


def test_sampled_requests_equal_generate_with_their_seed_and_stop_tokens_stop(params):
    config, p = CONFIGS["gqa"], params["gqa"]
    batch = prompts([5, 9, 14, 3], seed=1, vocab=config.vocab_size)
    settings = [dict(temperature=0.8, top_p=0.9, seed=3), dict(temperature=1.0, top_k=7, seed=4),
                dict(temperature=0.0), dict(temperature=0.7, min_p=0.1, seed=5)]
    stop = generate(config, p, [batch[2]], 6, stop_tokens=[])[0][4]  # greedy row's 5th token
    engine = Engine(config, p, max_batch=2, max_seq_len=64, stop_ids=[stop],
                    steps_per_dispatch=4)
    engine.start()
    try:
        results = run(engine, [dict(prompt=q, max_tokens=20, **s)
                               for q, s in zip(batch, settings)])
    finally:
        assert engine.stop(30)
    for q, s, result in zip(batch, settings, results):
        expected = generate(config, p, [q], 20, stop_tokens=[stop], **s)[0]
        assert result["tokens"] == expected
        assert result["reason"] == ("stop" if len(expected) < 20 else "length")
    assert results[2]["reason"] == "stop" and len(results[2]["tokens"]) <= 4


def test_a_failing_prefill_fails_only_its_request(params, monkeypatch):
    """A program that raises before it runs: its request gets the error, the others finish,
    and the engine serves the next request."""
    config, p = CONFIGS["gqa"], params["gqa"]
    engine = Engine(config, p, max_batch=2, max_seq_len=64, stop_ids=[], steps_per_dispatch=4)
    prefill = engine.programs.prefill_chunk

    def faulty(pages_1N, tokens_1L, start, last, *args):
        if last == 6:  # the 7-token prompt's one chunk
            raise RuntimeError("injected")
        return prefill(pages_1N, tokens_1L, start, last, *args)
    monkeypatch.setattr(engine.programs, "prefill_chunk", faulty)
    engine.start()
    try:
        batch = prompts([5, 7, 9], seed=2, vocab=config.vocab_size)
        results = run(engine, [dict(prompt=q, max_tokens=8) for q in batch])
        again = run(engine, [dict(prompt=batch[0], max_tokens=8)])
    finally:
        assert engine.stop(30)
    assert str(results[1]["error"]) == "injected"
    assert results[0]["reason"] == results[2]["reason"] == "length"
    assert again[0]["tokens"] == results[0]["tokens"]
    assert engine.finished == {"length": 3, "error": 1}


def test_the_pool_holds_what_the_planner_counts(params):
    """By default a row's pages of the context for every row: 3 rows of 100 positions in
    pages of 16 are 3 · 7 pages of the planner's bytes per token."""
    from llama_jax.plan.costs import kv_cache_bytes_per_token

    for cache_dtype in ("bfloat16", "int8"):
        engine = Engine(CONFIGS["mla"], params["mla"], max_batch=3, max_seq_len=100,
                        cache_dtype=cache_dtype, steps_per_dispatch=5)
        stored = sum(x.nbytes for x in jax.tree.leaves(engine.programs.rows.cache.groups))
        assert engine.shape.n_pages == 21
        assert stored == 21 * 16 * kv_cache_bytes_per_token(CONFIGS["mla"], cache_dtype)


def test_the_server_refuses_a_cache_that_does_not_fit(tmp_path, monkeypatch, capsys):
    """Before compiling anything, with the numbers, in one line."""
    from llama_jax.serve import app
    from llama_jax.serve.__main__ import main

    config = dataclasses.replace(TINY, vocab_size=320)
    llama_jax.save_native(config, llama_jax.init_params(config, jax.random.key(0)), tmp_path)
    _sentencepiece(tmp_path)
    monkeypatch.setattr(app, "free_memory_bytes", lambda: 1 << 14)
    assert main(["--checkpoint", str(tmp_path), "--max-batch", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 90% of the 16.0 KiB free after the weights (--kv-cache-bytes "
                          "by default) holds 1 pages of 16 positions (8192 bytes each), fewer "
                          "than the 16 of one row of --max-seq-len 256") and err.count("\n") == 1
    monkeypatch.setattr(app, "free_memory_bytes", lambda: 1 << 20)
    assert main(["--checkpoint", str(tmp_path), "--kv-cache-bytes", str(1 << 21)]) == 2
    assert capsys.readouterr().err.startswith(
        "error: the KV cache of --kv-cache-bytes 2097152 (float32) needs 0.00 GiB, but 0.00 "
        "GiB is free after loading the model")
    monkeypatch.setattr(app, "free_memory_bytes", lambda: 1 << 30)
    assert main(["--checkpoint", str(tmp_path), "--prefix-cache-bytes", str(1 << 31)]) == 2
    assert "--prefix-cache-bytes 2147483648 must be >= 0 and at most the 1.00 GiB free" in \
        capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path), "--prefill-chunk", "24"]) == 2
    assert capsys.readouterr().err == \
        "error: prefill_chunk=24 (--prefill-chunk) must be a power of two >= 16\n"
    other = dataclasses.replace(config, vocab_size=300)
    llama_jax.save_native(other, llama_jax.init_params(other, jax.random.key(1)),
                          tmp_path / "draft")
    assert main(["--checkpoint", str(tmp_path), "--draft-checkpoint",
                 str(tmp_path / "draft")]) == 2
    assert capsys.readouterr().err.startswith(
        "error: the draft model's vocabulary (300 tokens) is not the model's (320)")
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path), "--speculate", "draft"])
    assert "--speculate draft needs --draft-checkpoint DIR" in capsys.readouterr().err


def test_the_cache_check_fits_the_rows_pages_to_the_memory_left(params, monkeypatch):
    """Memory left for 16 pages of 16 positions holds 4 plain rows of 64 positions whole; a
    speculating server's rows are 4 positions longer (5 pages each): the pool is then the 16
    pages that fit, 8 beside a draft model's pages of the same size. Less than one row, or
    more --kv-cache-bytes than is free, is refused, naming the flag."""
    from llama_jax.decode.decoder import page_bytes
    from llama_jax.plan.serving import KV_CACHE_SHARE
    from llama_jax.serve import app

    config, weights = CONFIGS["gqa"], params["gqa"]
    each = page_bytes(config, weights, 16, "float32", None)
    check = functools.partial(app.check_cache_fits, config, weights, "float32", None,
                              prefix_cache_bytes=0, max_batch=4, max_seq_len=64)
    monkeypatch.setattr(app, "free_memory_bytes", lambda: int(16 * each / KV_CACHE_SHARE) + 16)
    plain, speculating = check(), check(speculative_tokens=4)
    assert (plain.rows_pages, plain.cache_len) == (16, 64)
    assert (speculating.rows_pages, speculating.cache_len) == (16, 68)
    assert check(speculative_tokens=4, draft=(config, weights)).rows_pages == 8
    with pytest.raises(GenerateError, match=f"--kv-cache-bytes {18 * each} .float32. needs"):
        check(kv_cache_bytes=18 * each)
    monkeypatch.setattr(app, "free_memory_bytes", lambda: int(4 * each / KV_CACHE_SHARE) - 1)
    with pytest.raises(GenerateError, match="holds 3 pages .* fewer than the 4 of one row"):
        check()


def _sentencepiece(directory):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["[INST] hello there [/INST]"] * 50),
                                   model_writer=model, vocab_size=300, model_type="bpe",
                                   byte_fallback=True, minloglevel=2)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    return llama_jax.load_tokenizer(directory)


def test_requests_that_cannot_run_are_refused_with_the_lengths(params):
    engine = Engine(CONFIGS["gqa"], params["gqa"], max_batch=2, max_seq_len=32)
    with pytest.raises(GenerateError, match="20 tokens and 13 more.*33 > .*32"):
        engine.submit(Request([1] * 20, 13, lambda _: None))
    with pytest.raises(GenerateError, match="outside the vocabulary"):
        engine.submit(Request([1, 10 ** 6], 3, lambda _: None))
    for setting, value in (("temperature", -1.0), ("top_k", -1), ("top_p", 0.0),
                           ("top_p", 1.5), ("min_p", 1.0)):  # the same ranges as generate's
        with pytest.raises(GenerateError, match=f"{setting}={value} must be"):
            engine.submit(Request([1, 2], 3, lambda _: None, **{setting: value}))
        with pytest.raises(GenerateError, match=f"{setting}={value} must be"):
            generate(CONFIGS["gqa"], params["gqa"], [[1, 2]], 3, **{setting: value})
    with pytest.raises(GenerateError, match="max_seq_len=999"):
        Engine(CONFIGS["gqa"], params["gqa"], max_seq_len=999)
    with pytest.warns(UserWarning, match=r"stop ids \[1000000\] are outside the vocabulary"):
        engine = Engine(CONFIGS["gqa"], params["gqa"], max_batch=2, max_seq_len=32,
                        stop_ids=[5, 10 ** 6])  # as generate: ignored, with a warning
    assert engine.stop_ids == [5]


def test_every_program_takes_the_rows_any_program_returns(params):
    """The rows rest between programs in one structure whatever table width a program ran
    at: an executable compiled once takes the rows of any other (else each call after a
    change of width would miss the compiled program and compile again)."""
    from llama_jax.decode import batching as programs
    from llama_jax.decode.sampling import Strategy

    config, p = CONFIGS["gqa"], params["gqa"]
    rows = programs.empty_rows(np.asarray([-1], np.int32), config=config, batch=2, n_pages=8,
                               page_size=16, max_len=64, cache_dtype="float32",
                               layout="stacked", placement=None)
    tables = {width: np.arange(2 * width, dtype=np.int32).reshape(2, width) for width in (2, 4)}
    compiled = {width: programs.decode.lower(
        rows, p, table, config=config, n_steps=1, strategy=Strategy(False, False), top=0,
        placement=None).compile() for width, table in tables.items()}
    for width in (2, 4, 2):
        rows, _ = compiled[width](rows, p, tables[width])


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_copied_pages_hold_what_their_sources_hold(layout, name):
    """`copied_pages` copies whole pages of every layer's pool (a prompt's last page, for a
    further choice of it), and leaves the others as they were."""
    config = CONFIGS[name]
    rng = np.random.default_rng(0)
    pool = init_paged_cache(config, 6, 4, jnp.zeros((1, 1), jnp.int32), "float32",
                            layout=layout)
    pool = pool.replace(groups=jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), pool.groups))
    copied = copied_pages(pool, jnp.asarray([4, 1]), jnp.asarray([0, 5]))
    for before, after in zip(jax.tree.leaves(pool.groups), jax.tree.leaves(copied.groups)):
        axis = 1 if layout == "stacked" else 0
        before, after = (np.moveaxis(np.asarray(x), axis, 0) for x in (before, after))
        np.testing.assert_array_equal(after[[0, 5]], before[[4, 1]])
        np.testing.assert_array_equal(after[1:5], before[1:5])


# ------------------------------------------------------------------------- text and chat

class Pieces:
    """A tokenizer whose tokens are given strings (ids 0..): decoding joins them."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids):
        data = b"".join(self.pieces[i] for i in ids)
        return data.decode("utf-8", errors="replace")


def test_stop_text_releases_whole_characters_and_stops_exactly():
    snow = "\u2603".encode()  # 3 bytes, split over tokens 1, 2, 3
    tok = Pieces([b"ab", snow[:1], snow[1:2], snow[2:], b"c<", b"/s", b">tail", b"<x"])
    text = StopText(tok, [], stops=["</s>", "zz"])
    assert text.push([0, 1]) == "ab"  # the partial character is held back
    assert text.push([2]) == ""
    assert text.push([3]) == "\u2603"
    assert text.push([4]) == "c"  # "<" may begin "</s>"
    assert text.push([5]) == "" and not text.stopped
    assert text.push([6]) == "" and text.stopped
    assert text.text == "ab\u2603c" and text.flush() == ""
    held = StopText(tok, [], stops=["<y"])
    assert held.push([4]) == "c" and held.flush() == "<" and not held.stopped
    assert StopText(tok, [], stops=["<y"]).push([7]) == "<x"  # "<x" cannot begin "<y"


def test_llama3_chat_equals_metas_format():
    llama_models = pytest.importorskip("llama_models")
    from llama_models.datatypes import RawMessage, StopReason
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

    path = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": " And 3+3?\n"}]
    expected = ChatFormat(MetaTokenizer(path)).encode_dialog_prompt([
        RawMessage(role=m["role"], content=m["content"], stop_reason=StopReason.end_of_turn)
        for m in messages]).tokens
    assert llama3_chat(llama_jax.load_tokenizer(path), messages) == expected


def test_llama2_chat_format_and_its_refusals(tmp_path):
    tok = _sentencepiece(tmp_path)
    ids = llama2_chat(tok, [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                            {"role": "assistant", "content": "a1"},
                            {"role": "user", "content": "u2"}])
    assert ids == (tok.encode("[INST] <<SYS>>\nS\n<</SYS>>\n\nu1 [/INST] a1 ", eos=True)
                   + tok.encode("[INST] u2 [/INST]"))
    with pytest.raises(GenerateError, match="alternate"):
        llama2_chat(tok, [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
    assert encode_with_special_tokens(tok, "<s>hello</s>") == (
        [tok.bos_id] + tok.encode("hello", bos=False) + [tok.eos_ids[0]])


def test_a_checkpoints_chat_template_is_rendered(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": {"content": "<s>"}}))

    class Tok:
        special_tokens = {"<s>": 1}
        bos_id = 1

        def encode(self, text, bos=True):
            return [1] * bos + [ord(c) for c in text]

    ids = chat_format(tmp_path, Tok())([{"role": "user", "content": "hi"}])
    assert ids == [1] + [ord(c) for c in "<|user|>hi<|assistant|>"]
