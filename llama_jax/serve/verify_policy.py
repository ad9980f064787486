"""When a speculating server's next program runs verify passes: the host's side of the
auto-off (`speculate.worth_a_pass`), which must decide as the device would from rates it can
read without waiting for the program still running."""

from __future__ import annotations

import numpy as np

from llama_jax.decode.speculate import HIT_RATE_START, Speculation, worth_a_pass


class VerifyPolicy:
    """The rates of first guesses right of `batch` rows after each decode program read (the
    last two kept), and the decode program each row's request was inserted before."""

    def __init__(self, spec: Speculation, batch: int):
        self.spec = spec
        self.rates: dict[int, np.ndarray] = {}
        self.inserted_before = [0] * batch

    def inserted(self, b: int, program: int) -> None:
        """A request entered row `b` before decode program `program` (counted from 0)."""
        self.inserted_before[b] = program

    def read(self, number: int, hit_rate_B: np.ndarray) -> None:
        """Decode program `number`'s rates, read."""
        self.rates = {number: hit_rate_B, **{n: r for n, r in self.rates.items()
                                             if n == number - 1}}

    def worth_verifying(self, p: int, decoding_B: np.ndarray) -> bool:
        """Whether decode program `p`'s rounds should run verify passes, for the rows
        `decoding_B`: by the rates as program p - 2 left them (read by now without waiting
        for p - 1), a fresh request's where a row's request came later."""
        rates = self.rates.get(p - 2, np.full(len(decoding_B), HIT_RATE_START, np.float32))
        rates = np.where(np.asarray(self.inserted_before) >= p - 1, HIT_RATE_START, rates)
        return worth_a_pass(rates, decoding_B, self.spec)
