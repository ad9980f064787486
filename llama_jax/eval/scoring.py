"""Log-likelihood scoring of token sequences: the zero-shot evaluation primitive.

    scores = score(config, params, [[1, 415, 2936], [1, 22]], [[3290], [17, 9]])
    scores[0].logprob, scores[0].greedy  # log P(continuation | context), is it the argmax path

A request is a (context, continuation) pair of token-id lists. The model reads
`context + continuation[:-1]` and the log-probabilities of the continuation's tokens are read
at the positions that predict them (the last context token's onwards), log-softmax in fp32,
summed on the host in float64. A request longer than the model's context drops context tokens
from the left, as lm-evaluation-harness does: the input keeps the last `max_len` tokens.

Batching: requests are sorted by length (longest first) and scored `rows` at a time; the
results come back in the input order. Rows are right-padded, and since attention is causal a
row's real tokens never see its padding, so a request scores the same alone or in any batch.
Shapes are padded to buckets (`decoder.bucket`: the input length T, and K, the longest
continuation, to powers of two; the batch to a fixed number of rows) so that a whole
evaluation compiles a handful of programs. The LM head runs only at the K scored positions of
each row: the logits are `[B, K, V]`, not `[B, T, V]`, which for a long context and a 128k
vocabulary is the difference between megabytes and tens of gigabytes.

`perplexity` scores whole documents with strided sliding windows, built on `score`.

With `cache_dtype` (e.g. "int8"), the model reads each input as the decoder reads a prompt: in
one pass through a KV cache of that dtype, so that its keys and values are attended as that
cache stores them — how the quality of a quantized cache is measured.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.errors import ConfigError, ScoreError
from llama_jax.config import ModelConfig, cache_dtype_name
from llama_jax.shapes import bucket
from llama_jax.model.kv_cache import init_cache
from llama_jax.model.transformer import apply
from llama_jax.nn.heads import is_task_head, lm_head
from llama_jax.model.params import Params
from llama_jax.decode.sampling import argmax



class Score(NamedTuple):
    logprob: float  # log P(continuation | context): the sum over the continuation's tokens
    greedy: bool  # every continuation token is the argmax: greedy decoding would produce it


class Perplexity(NamedTuple):
    nll: float  # the negative log-likelihood (nats) of the document's tokens after the first
    n_tokens: int  # how many tokens that is

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.n_tokens)


def score(config: ModelConfig, params: Params, contexts: Sequence[Sequence[int]],
          continuations: Sequence[Sequence[int]], *, batch_size: int = 32,
          max_len: int | None = None, cache_dtype=None) -> list[Score]:
    """One `Score` per (context, continuation) pair, in the input order.

    A context needs at least one token (the caller puts BOS there) and a continuation too.
    `max_len` (default and at most `config.max_seq_len`) bounds the tokens the model reads per
    request: longer requests lose context tokens from the left; a continuation of more than
    `max_len` tokens cannot be scored. `batch_size` requests run at a time. `cache_dtype`
    (default: none) reads the inputs through a KV cache of that dtype (module docstring).
    """
    max_len = config.max_seq_len if max_len is None else max_len
    requests = _validate(config, contexts, continuations, batch_size, max_len)
    if cache_dtype is not None:
        try:
            cache_dtype = cache_dtype_name(cache_dtype, config.compute_dtype)
        except ConfigError as e:
            raise ScoreError(str(e)) from None
    if not requests:
        return []
    config = _dropless(config)
    rows = min(batch_size, bucket(len(requests), 1))
    order = sorted(range(len(requests)), key=lambda i: -_input_len(*requests[i]))
    scores = {}
    for start in range(0, len(order), rows):
        batch = order[start:start + rows]
        scores.update(zip(batch, _score_batch(config, params, [requests[i] for i in batch], rows,
                                              cache_dtype)))
    return [scores[i] for i in range(len(requests))]


def perplexity(config: ModelConfig, params: Params, documents: Sequence[Sequence[int]], *,
               window: int | None = None, stride: int | None = None,
               batch_size: int = 32, cache_dtype=None) -> list[Perplexity]:
    """The NLL of each document (token ids starting with BOS) over all its tokens after the
    first, by the standard strided evaluation: window k reads at most `window` tokens starting
    at k·stride (default window: `config.max_seq_len`) and scores those of its predictions
    that no earlier window scored, with its earlier tokens as context. The default stride,
    window // 2, gives every token past the first window at least window/2 tokens of context
    at twice the cost of disjoint windows; `stride=window` is disjoint windows (each later one
    conditioned on one token only); a smaller stride buys more context with more windows.
    `cache_dtype` as in `score`.
    """
    window = config.max_seq_len if window is None else window
    stride = max(window // 2, 1) if stride is None else stride
    if not 1 <= window <= config.max_seq_len:
        raise ScoreError(f"window={window} must be in [1, max_seq_len={config.max_seq_len}]")
    if not 1 <= stride <= window:
        raise ScoreError(f"stride={stride} must be in [1, window={window}]: a longer stride "
                         "would skip tokens")
    contexts, continuations, owners, lengths = [], [], [], []
    for d, document in enumerate(documents):
        tokens = _ids(config, f"document {d}", document)
        if len(tokens) < 2:
            raise ScoreError(f"document {d} has {len(tokens)} token(s); it needs at least two "
                             "(BOS, then a token to score)")
        for context, continuation in _windows(tokens, window, stride):
            contexts.append(context)
            continuations.append(continuation)
            owners.append(d)
        lengths.append(len(tokens))
    nll = [0.0] * len(lengths)
    for d, s in zip(owners, score(config, params, contexts, continuations,
                                  batch_size=batch_size, cache_dtype=cache_dtype)):
        nll[d] -= s.logprob
    return [Perplexity(total, n - 1) for total, n in zip(nll, lengths)]


def _windows(tokens: np.ndarray, window: int, stride: int) -> Iterator[tuple]:
    """(context, continuation) per window: the window starting at `begin` reads tokens
    [begin, begin + window) and scores those after `scored` of the ones they predict."""
    begin, scored = 0, 1
    while scored < len(tokens):
        end = min(begin + window + 1, len(tokens))
        yield tokens[begin:scored], tokens[scored:end]
        begin, scored = begin + stride, end


@functools.partial(jax.jit, static_argnums=(0, 5))
def _token_logprobs(config: ModelConfig, params: Params, tokens_BT: jax.Array,
                    positions_BK: jax.Array, targets_BK: jax.Array, cache_dtype: str | None):
    """log P(targets_BK) from the logits at input positions `positions_BK`, and whether each
    target is the argmax there."""
    B, T = tokens_BT.shape
    cache = None if cache_dtype is None else init_cache(config, B, T, cache_dtype)
    h_BTD = apply(config, params, tokens_BT, cache=cache).hidden_BTD
    h_BKD = jnp.take_along_axis(h_BTD, positions_BK[..., None], axis=1)
    logits_BKV = lm_head(config, params, h_BKD)
    logprobs_BKV = jax.nn.log_softmax(logits_BKV.astype(jnp.float32))
    logprob_BK = jnp.take_along_axis(logprobs_BKV, targets_BK[..., None], axis=-1)[..., 0]
    return logprob_BK, argmax(logits_BKV) == targets_BK


def _score_batch(config: ModelConfig, params: Params, batch: list[tuple], rows: int,
                 cache_dtype: str | None) -> list[Score]:
    T = min(bucket(max(_input_len(*request) for request in batch)), config.max_seq_len)
    K = min(bucket(max(len(continuation) for _, continuation in batch)), T)
    tokens_BT = np.zeros((rows, T), np.int32)  # padding rows and columns: token 0, unread
    positions_BK = np.zeros((rows, K), np.int32)
    targets_BK = np.zeros((rows, K), np.int32)
    for b, (context, continuation) in enumerate(batch):
        inputs = np.concatenate([context, continuation[:-1]])
        tokens_BT[b, :len(inputs)] = inputs
        positions_BK[b, :len(continuation)] = np.arange(len(context) - 1, len(inputs))
        targets_BK[b, :len(continuation)] = continuation
    logprob_BK, greedy_BK = jax.device_get(
        _token_logprobs(config, params, tokens_BT, positions_BK, targets_BK, cache_dtype))
    return [Score(float(np.sum(logprob_BK[b, :len(c)], dtype=np.float64)),
                  bool(np.all(greedy_BK[b, :len(c)]))) for b, (_, c) in enumerate(batch)]


def _input_len(context: np.ndarray, continuation: np.ndarray) -> int:
    return len(context) + len(continuation) - 1


def _validate(config: ModelConfig, contexts: Sequence[Sequence[int]],
              continuations: Sequence[Sequence[int]], batch_size: int, max_len: int
              ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The requests as (context, continuation) id arrays, contexts truncated to fit."""
    if is_task_head(config):
        raise ScoreError(f"the model has a {config.head!r} head; scoring tokens needs the "
                         "language-model head (head='lm')")
    if len(contexts) != len(continuations):
        raise ScoreError(f"{len(contexts)} contexts but {len(continuations)} continuations: "
                         "give one of each per request")
    if batch_size < 1:
        raise ScoreError(f"batch_size={batch_size} must be >= 1")
    if not 1 <= max_len <= config.max_seq_len:
        raise ScoreError(f"max_len={max_len} must be in [1, max_seq_len={config.max_seq_len}]")
    requests = []
    for i, (context, continuation) in enumerate(zip(contexts, continuations)):
        context = _ids(config, f"request {i}: the context", context)
        continuation = _ids(config, f"request {i}: the continuation", continuation)
        if len(context) == 0:
            raise ScoreError(f"request {i}: the context is empty; it needs at least one token "
                             "(e.g. BOS)")
        if len(continuation) == 0:
            raise ScoreError(f"request {i}: the continuation is empty; there is nothing to score")
        if len(continuation) > max_len:
            raise ScoreError(f"request {i}: the continuation has {len(continuation)} tokens; at "
                             f"most {max_len} (the model's context) can be scored")
        drop = max(_input_len(context, continuation) - max_len, 0)  # keeps >= 1 context token
        requests.append((context[drop:], continuation))
    return requests


def _ids(config: ModelConfig, what: str, ids: Sequence[int]) -> np.ndarray:
    ids = np.asarray(ids, np.int64)
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if len(bad):
        raise ScoreError(f"{what} has token id(s) {bad[:5].tolist()} outside the vocabulary "
                         f"[0, {config.vocab_size})")
    return ids


def _dropless(config: ModelConfig) -> ModelConfig:
    """MoE capacity is counted per row, so padding would compete with a request's own tokens
    for expert slots: scoring never drops tokens, as the cached decoder does (nn/moe.py)."""
    if getattr(config.moe, "capacity_factor", None) is None:
        return config
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, capacity_factor=None))
