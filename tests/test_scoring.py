"""Log-likelihood scoring: scores equal a float64 reference, batching and padding change
nothing, long requests lose context from the left, strided perplexity, scoring through a KV
cache equals the decoder, and bad input."""

import dataclasses

import jax
import numpy as np
import pytest

import llama_jax
import reference
from llama_jax.eval.scoring import Perplexity, Score, _token_logprobs, perplexity, score
from llama_jax.errors import ScoreError

# Wide enough logits (init_std) that the argmax is never a near tie between fp32 and fp64;
# max_seq_len not a power of two, so the length bucket is capped by it.
CONFIG = dataclasses.replace(llama_jax.load_model_config("tiny"), vocab_size=96, max_seq_len=48,
                             init_std=0.2)


@pytest.fixture(scope="module")
def params():
    return llama_jax.init_params(CONFIG, jax.random.key(0))


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, n).tolist()


def reference_logprobs(params, sequence):
    """float64 log-softmax of the float64 reference forward: row t predicts token t + 1."""
    logits = reference.forward(CONFIG, params, np.array([sequence]))[0]
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def reference_score(params, context, continuation):
    logprobs = reference_logprobs(params, context + continuation)
    rows = np.arange(len(context) - 1, len(context) + len(continuation) - 1)
    logprob = float(logprobs[rows, continuation].sum())
    return logprob, bool(np.all(logprobs[rows].argmax(-1) == continuation))


def greedy_continuation(params, context, n):
    sequence = list(context)
    for _ in range(n):
        sequence.append(int(reference_logprobs(params, sequence)[-1].argmax()))
    return sequence[len(context):]


def test_scores_equal_the_float64_reference(params):
    """Ragged requests over several batches (batch_size 3 < 7 requests), in the input order;
    one continuation is the model's own greedy path."""
    shapes = [(1, 1), (5, 3), (12, 7), (2, 20), (30, 4), (9, 1), (17, 12)]
    contexts = [tokens(c, seed=i) for i, (c, _) in enumerate(shapes)]
    continuations = [tokens(n, seed=100 + i) for i, (_, n) in enumerate(shapes)]
    continuations[4] = greedy_continuation(params, contexts[4], 4)
    scores = score(CONFIG, params, contexts, continuations, batch_size=3)
    expected = [reference_score(params, c, x) for c, x in zip(contexts, continuations)]
    for got, (logprob, greedy) in zip(scores, expected):
        assert isinstance(got, Score)
        assert got.logprob == pytest.approx(logprob, abs=1e-4)
        assert got.greedy == greedy
    assert expected[4][1] and not expected[2][1]  # both flags occur


def test_a_request_scores_the_same_alone_as_in_a_padded_batch(params):
    contexts = [tokens(n, seed=10 + n) for n in (3, 25, 8, 14)]
    continuations = [tokens(n, seed=20 + n) for n in (9, 2, 16, 1)]
    together = score(CONFIG, params, contexts, continuations, batch_size=4)
    for context, continuation, got in zip(contexts, continuations, together):
        alone = score(CONFIG, params, [context], [continuation])[0]
        # fp32 sums over other shapes: a few roundings of each term (measured: 2.5e-7)
        assert got.logprob == pytest.approx(alone.logprob, rel=1e-5)
        assert got.greedy == alone.greedy


def test_moe_scores_do_not_depend_on_the_batch():
    """Expert capacity is per row, so padding would take a request's expert slots: scoring
    drops no tokens (a capacity factor this low drops many in `forward`)."""
    moe = llama_jax.load_model_config("moe-demo")
    config = dataclasses.replace(CONFIG, mlp="moe", moe=dataclasses.replace(
        moe.moe, expert_ffn_dim=32, capacity_factor=0.3))
    p = llama_jax.init_params(config, jax.random.key(1))
    contexts, continuations = [tokens(5, seed=50), tokens(30, seed=51)], [tokens(3, seed=52)] * 2
    together = score(config, p, contexts, continuations)
    for context, continuation, got in zip(contexts, continuations, together):
        alone = score(config, p, [context], [continuation])[0]
        assert got.logprob == pytest.approx(alone.logprob, rel=1e-5)  # as above


def test_a_long_request_loses_context_from_the_left(params):
    """lm-eval's rule: the model reads the last max_seq_len tokens of context +
    continuation[:-1]."""
    context, continuation = tokens(60, seed=30), tokens(6, seed=31)
    kept = context[-(CONFIG.max_seq_len + 1 - len(continuation)):]
    long, fitted = score(CONFIG, params, [context, kept], [continuation] * 2)
    assert long.logprob == pytest.approx(fitted.logprob, abs=1e-6)
    assert long.greedy == fitted.greedy
    assert long.logprob == pytest.approx(reference_score(params, kept, continuation)[0],
                                         abs=1e-4)
    assert score(CONFIG, params, [context], [continuation], max_len=20)[0].logprob == \
        pytest.approx(reference_score(params, context[-15:], continuation)[0], abs=1e-4)


def test_strided_perplexity_equals_the_windows_by_hand(params):
    """Window k reads tokens [8k, 8k + 16); token t is scored by the first window that reads
    the token before it, with that window's tokens before t as its context."""
    document = tokens(40, seed=40)
    window, stride = 16, 8
    nll = 0.0
    for t in range(1, len(document)):
        k = max(0, -(-(t - window) // stride))
        begin = k * stride
        nll -= reference_logprobs(params, document[begin:t + 1])[t - 1 - begin, document[t]]
    got = perplexity(CONFIG, params, [document], window=window, stride=stride)[0]
    assert isinstance(got, Perplexity) and got.n_tokens == 39
    assert got.nll == pytest.approx(nll, abs=1e-4)
    assert got.ppl == pytest.approx(np.exp(nll / 39), rel=1e-6)


def test_perplexity_in_one_window_is_one_forward(params):
    documents = [tokens(40, seed=41), tokens(2, seed=42), tokens(48, seed=43)]
    expected = []
    for document in documents:
        logprobs = reference_logprobs(params, document)
        expected.append(-logprobs[np.arange(len(document) - 1), document[1:]].sum())
    got = perplexity(CONFIG, params, documents)  # window: max_seq_len 48
    assert [p.n_tokens for p in got] == [39, 1, 47]
    np.testing.assert_allclose([p.nll for p in got], expected, atol=1e-4)
    exact = perplexity(CONFIG, params, documents[:1], window=39, stride=1)[0]  # 39 predictions
    assert exact.nll == pytest.approx(expected[0], abs=1e-4)


def test_scoring_through_a_cache_equals_the_decoder(params):
    """Through a float cache the scores are the plain forward's; through an int8 cache they are
    the log-probabilities the int8-cache decoder gives its own greedy tokens (a vector's scale
    depends on it alone, so prefill and step-by-step quantize every key and value alike)."""
    contexts = [tokens(n, seed=60 + n) for n in (4, 13, 7)]
    continuations = [tokens(n, seed=70 + n) for n in (5, 2, 11)]
    plain = score(CONFIG, params, contexts, continuations)
    cached = score(CONFIG, params, contexts, continuations, cache_dtype="float32")
    for a, b in zip(plain, cached):
        assert a.logprob == pytest.approx(b.logprob, rel=1e-5) and a.greedy == b.greedy
    new, logprobs = llama_jax.generate(CONFIG, params, contexts, 8, stop_tokens=[],
                                       cache_dtype="int8", return_logprobs=True)
    int8 = score(CONFIG, params, contexts, new, cache_dtype="int8")
    for s, expected in zip(int8, logprobs):
        assert s.logprob == pytest.approx(sum(expected), abs=1e-4) and s.greedy
    assert [s.logprob for s in int8] != pytest.approx(
        [s.logprob for s in score(CONFIG, params, contexts, new)], abs=1e-4)  # int8 applies
    with pytest.raises(ScoreError, match="cache_dtype='int4' is not one of .*int8"):
        score(CONFIG, params, contexts, new, cache_dtype="int4")


class Headed:
    """The config with another head, whether or not ModelConfig has a `head` field yet."""

    def __init__(self, config, head):
        self._config, self.head = config, head

    def __getattr__(self, name):
        return getattr(self._config, name)


@pytest.mark.parametrize("request_, message", [
    (dict(contexts=[[1, 2], []]), "request 1: the context is empty"),
    (dict(continuations=[[]]), "request 0: the continuation is empty"),
    (dict(continuations=[[3, 96]]), r"request 0: the continuation has token id\(s\) \[96\] "
                                    r"outside the vocabulary \[0, 96\)"),
    (dict(contexts=[[-1, 4]]), r"request 0: the context has token id\(s\) \[-1\]"),
    (dict(continuations=[[1] * 49]), "request 0: the continuation has 49 tokens; at most 48"),
    (dict(continuations=[[1], [2]]), "1 contexts but 2 continuations"),
    (dict(batch_size=0), "batch_size=0"),
    (dict(max_len=49), r"max_len=49 must be in \[1, max_seq_len=48\]"),
    (dict(config=Headed(CONFIG, "sequence_classification")),
     "the model has a 'sequence_classification' head"),
])
def test_bad_requests_fail_before_compiling(params, request_, message):
    kwargs = {"config": CONFIG, "contexts": [[1, 2]], "continuations": [[3]], **request_}
    if "contexts" in request_ and "continuations" not in request_:
        kwargs["continuations"] = [[3]] * len(kwargs["contexts"])
    compiled = _token_logprobs._cache_size()
    with pytest.raises(ScoreError, match=message):
        score(params=params, **kwargs)
    assert _token_logprobs._cache_size() == compiled


@pytest.mark.parametrize("kwargs, message", [
    (dict(documents=[[1]]), "document 0 has 1 token"),
    (dict(documents=[[1, 2], [1, 200]]), r"document 1 has token id\(s\) \[200\]"),
    (dict(window=49), r"window=49 must be in \[1, max_seq_len=48\]"),
    (dict(window=8, stride=9), r"stride=9 must be in \[1, window=8\]"),
])
def test_bad_perplexity_requests(params, kwargs, message):
    with pytest.raises(ScoreError, match=message):
        perplexity(CONFIG, params, **{"documents": [[1, 2, 3]], **kwargs})
