"""EleutherAI lm-evaluation-harness adapter: llama_jax checkpoints as lm-eval's model
"llama_jax" (`pip install 'llama_jax[eval]'`).

    python -m llama_jax.eval.harness --model llama_jax \\
        --model_args checkpoint=DIR,dtype=bfloat16,batch_size=16 --tasks arc_easy,hellaswag

takes lm-eval's own command-line arguments. In Python, after `import llama_jax.eval.harness`:

    lm_eval.simple_evaluate(model="llama_jax", model_args="checkpoint=DIR", tasks=["arc_easy"])

Plain `lm_eval --model llama_jax` does not find the model: lm-eval (0.4.13) looks models up in
an in-process registry filled from its own table of built-in models, with no plugin discovery
(no entry points), so "llama_jax" exists only in a process that imported this module. Running
this module imports it and then hands the same arguments to lm-eval's CLI.

Model arguments (`--model_args`; lm-eval passes strings, converted here): `checkpoint`
(required: any directory `load_checkpoint` reads), `tokenizer` (a tokenizer file or directory;
default: the checkpoint's tokenizer.model), `dtype` (default: as stored), `batch_size` (requests
scored or decoded at a time; it takes precedence over `--batch_size`, whose default of 1 lm-eval
always passes), `max_length` (tokens the model reads per request; default and at most
max_seq_len), `max_gen_toks` (256) and `seed` (0: for sampled generation).

The three request kinds:
- loglikelihood: tokenized as lm-eval's HFLM tokenizes for LLaMA (`TemplateLM`): the context
  with BOS (an empty context is BOS alone), its trailing spaces moved onto the continuation,
  and the continuation the tokens of context + continuation past the context's own; then
  `scoring.score`, which truncates long requests from the left.
- loglikelihood_rolling: the text's tokens (no BOS) in lm-eval's rolling windows of
  `max_length` predictions, the first conditioned on BOS, the last with a full context; each
  window is a request to `scoring.score`, and a document's windows are summed.
- generate_until: BOS + context (left-truncated to `max_length - max_gen_toks` tokens) through
  the KV-cached decoder, a batch at a time; greedy unless the request samples (`do_sample`,
  temperature > 0; top_k, top_p, min_p are honoured). Decoding stops at EOS, and once every row
  of the batch has produced one of the stop strings; the text is cut at the first of them.
"""

from __future__ import annotations

import importlib
from typing import Sequence

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import (get_rolling_token_windows, make_disjoint_window,
                               simple_parse_args_string)
except ImportError:
    raise ImportError("llama_jax.eval.harness needs lm-eval: pip install 'llama_jax[eval]'"
                      ) from None

from llama_jax.formats.checkpoint import load_checkpoint
from llama_jax.decode.generate import stream
from llama_jax.eval.scoring import score
from llama_jax.data.tokenizer import TextStream, load_tokenizer

MODEL_NAME = "llama_jax"
SAMPLING_KWARGS = ("top_k", "top_p", "min_p")
# Decode steps between checks of the stop strings: each check is a host round trip.
STOP_CHECK_STEPS = 16


class LlamaJaxLM(TemplateLM):
    """A llama_jax checkpoint behind lm-eval's `LM` interface (see the module docstring).
    `max_batch_size` and `device`, which lm-eval passes to every model, are not used: the batch
    size is fixed and JAX places arrays on its default device."""

    def __init__(self, checkpoint: str, tokenizer: str | None = None, dtype: str | None = None,
                 batch_size: int | str = 8, max_length: int | str | None = None,
                 max_gen_toks: int | str = 256, seed: int | str = 0,
                 max_batch_size: int | None = None, device: str | None = None):
        super().__init__()
        self.config, self.params = load_checkpoint(checkpoint, dtype)
        self.tokenizer = load_tokenizer(checkpoint if tokenizer is None else tokenizer)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_length = (self.config.max_seq_len if max_length is None
                           else _positive_int("max_length", max_length))
        if self.max_length > self.config.max_seq_len:
            raise ValueError(f"max_length={self.max_length} exceeds the model's context "
                             f"(max_seq_len {self.config.max_seq_len})")
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self.seed = int(seed)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """`--model_args` over lm-eval's own settings: its CLI always passes batch_size (1 by
        default), which would otherwise clash with a batch_size in the model arguments."""
        settings = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**settings, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_ids[0]

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs
                   ) -> list[int]:
        """BOS + the text's tokens (without BOS when `add_special_tokens` is False)."""
        return self.tokenizer.encode(string, bos=add_special_tokens is not False)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        scores = score(self.config, self.params, [context for _, context, _ in requests],
                       [continuation for _, _, continuation in requests],
                       batch_size=self.batch_size, max_len=self.max_length)
        return [(s.logprob, s.greedy) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        contexts, continuations, owners = [], [], []
        for i, (text,) in enumerate(request.args for request in requests):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(text, add_special_tokens=False),
                prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                contexts.append(context)
                continuations.append(continuation)
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, s in zip(owners, score(self.config, self.params, contexts, continuations,
                                      batch_size=self.batch_size, max_len=self.max_length)):
            totals[i] += s.logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their generation settings, longest context first in each."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        texts: list[str] = [""] * len(requests)
        for indices in groups.values():
            indices.sort(key=lambda i: -len(requests[i].args[0]))
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start:start + self.batch_size]
                outputs = self._generate([requests[i].args[0] for i in batch],
                                         requests[batch[0]].args[1])
                for i, text in zip(batch, outputs):
                    texts[i] = text
        return texts

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        until, max_new, sampling = _generation_settings(gen_kwargs, self.max_gen_toks)
        max_context = self.max_length - max_new
        if max_context < 1:
            raise ValueError(f"max_gen_toks={max_new} leaves no room for a context in "
                             f"max_length={self.max_length} tokens")
        prompts = [self.tok_encode(context)[-max_context:] for context in contexts]
        # Each row's text as a continuation of its prompt (decoded alone, SentencePiece would
        # drop the space of the first piece), without a trailing partial UTF-8 character.
        streams = [TextStream(self.tokenizer, prompt) for prompt in prompts]
        texts = [""] * len(prompts)
        for chunk, _ in stream(self.config, self.params, prompts, max_new, seed=self.seed,
                               stop_tokens=self.tokenizer.eos_ids,
                               chunk_steps=STOP_CHECK_STEPS, **sampling):
            texts = [text + s.push(tokens) for text, s, tokens in zip(texts, streams, chunk)]
            if until and all(any(stop in text for stop in until) for text in texts):
                break  # the rest of the stream is never computed
        return [_cut(text + s.flush(), until) for text, s in zip(texts, streams)]


def _generation_settings(gen_kwargs: dict, max_gen_toks: int) -> tuple[list[str], int, dict]:
    """(stop strings, max new tokens, `stream` sampling arguments) from lm-eval's gen_kwargs.
    As lm-eval: greedy when do_sample is false, or unset with no positive temperature; a
    sampling request without a temperature samples at 1."""
    kwargs = dict(gen_kwargs)
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else [stop for stop in until if stop]
    max_new = _positive_int("max_gen_toks", kwargs.pop("max_gen_toks", max_gen_toks))
    do_sample = kwargs.pop("do_sample", None)
    temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
    sampling = {"temperature": 0.0 if do_sample is False else temperature}
    sampling.update((name, kwargs.pop(name)) for name in SAMPLING_KWARGS if name in kwargs)
    if kwargs:
        raise ValueError(f"generation kwargs {sorted(kwargs)} are not supported; llama_jax "
                         f"reads until, max_gen_toks, do_sample, temperature, "
                         f"{', '.join(SAMPLING_KWARGS)}")
    return until, max_new, sampling


def _cut(text: str, until: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string."""
    return text[:min((text.find(stop) for stop in until if stop in text), default=len(text))]


def _positive_int(name: str, value) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


# lm-eval fills its model registry with the built-in models (lazily, by name) when
# `lm_eval.models` is imported, and `get_model` imports it only into an empty registry: that
# import comes first, or registering "llama_jax" would hide every built-in model.
importlib.import_module("lm_eval.models")
register_model(MODEL_NAME)(LlamaJaxLM)


def main() -> None:
    """lm-eval's command line (the `lm_eval` arguments) with "llama_jax" registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
