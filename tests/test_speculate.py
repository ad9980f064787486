"""Speculative decoding's proposers against plain-Python references."""

import jax
import numpy as np
import pytest

from llama_jax.decode.speculate import ngram_proposals


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The k (or fewer) tokens after the latest earlier occurrence of the longest suffix
    n-gram, n from max_n down to min_n; none when no n recurs."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > L:
            continue
        suffix = tokens[L - n:]
        for i in range(L - n - 1, -1, -1):  # a token must follow the window
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


@pytest.mark.parametrize("k, min_n, max_n", [(4, 1, 3), (2, 2, 2), (7, 1, 5)])
def test_ngram_proposals_equal_the_reference(k, min_n, max_n):
    """Random rows over a 4-token vocabulary (so n-grams recur) of every length up to the
    buffer, padded with random tokens after their length (never looked at)."""
    rng = np.random.default_rng(k)
    N, B = 24, 64
    tokens_BN = rng.integers(0, 4, (B, N)).astype(np.int32)
    length_B = rng.integers(1, N + 1, B).astype(np.int32)
    length_B[:3] = (1, N, max_n)
    proposals, counts = jax.jit(ngram_proposals, static_argnums=(2, 3, 4))(
        tokens_BN, length_B, k, min_n, max_n)
    for row, length, proposal, count in zip(tokens_BN, length_B, np.asarray(proposals),
                                            np.asarray(counts)):
        expected = reference(row[:length].tolist(), k, min_n, max_n)
        assert proposal[:count].tolist() == expected
    assert (np.asarray(counts) > 0).any() and (np.asarray(counts) == 0).any()


def test_bad_ngram_settings_are_refused():
    with pytest.raises(ValueError, match="ngram=\\(3, 2\\)"):
        ngram_proposals(np.zeros((1, 8), np.int32), np.ones(1, np.int32), 2, 3, 2)
