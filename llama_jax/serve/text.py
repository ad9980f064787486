"""A request's generated text as its tokens arrive: whole UTF-8 characters only, cut exactly
before the first stop string, and never released past one.

    text = StopText(tokenizer, prompt_ids, stops=["\\n\\n"])
    for token in tokens:
        print(text.push([token]), end="")   # "" while a character or a stop string may begin
        if text.stopped: break
    print(text.flush())

Text that could be the beginning of a stop string is held back until the next tokens show
whether it is one; a stop string may span any number of tokens.
"""

from __future__ import annotations

from typing import Sequence

from llama_jax.data.tokenizer import TextStream, Tokenizer


class StopText:
    def __init__(self, tokenizer: Tokenizer, context: Sequence[int], stops: Sequence[str] = ()):
        self._stream = TextStream(tokenizer, context)
        self._stops = [s for s in stops if s]
        self._held = ""  # decoded, not yet released: it may begin a stop string
        self.text = ""  # everything released
        self.stopped = False  # a stop string was found; nothing more is released

    @property
    def decoded(self) -> int:
        """The length of the text decoded so far (released or held back)."""
        return len(self.text) + len(self._held)

    def push(self, ids: Sequence[int]) -> str:
        """The text that `ids` release."""
        if self.stopped:
            return ""
        self._held += self._stream.push(ids)
        return self._release(final=False)

    def flush(self) -> str:
        """What is held back, once no token will follow."""
        if self.stopped:
            return ""
        self._held += self._stream.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        found = [i for i in (self._held.find(s) for s in self._stops) if i >= 0]
        if found:
            out, self._held, self.stopped = self._held[:min(found)], "", True
        else:
            cut = len(self._held) - (0 if final else _longest_stop_prefix(self._held, self._stops))
            out, self._held = self._held[:cut], self._held[cut:]
        self.text += out
        return out


def _longest_stop_prefix(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins some stop string."""
    return max((n for stop in stops for n in range(min(len(stop) - 1, len(text)), 0, -1)
                if text.endswith(stop[:n])), default=0)
