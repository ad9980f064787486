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
(required: any directory `load_checkpoint` reads), `tokenizer` (a directory or file; default:
the checkpoint's), `dtype` (default: as stored), `quantize` (`int8`: int8 weights, quantized
while loading) and `cache_dtype` (e.g. `int8`: every request is read through a KV cache of that
dtype, as the decoder reads a prompt; default: the plain forward for scoring and the compute
dtype for generation), `batch_size` (requests scored or decoded at a
time; it takes precedence over `--batch_size`, whose default of 1 lm-eval always passes),
`max_length` (tokens the model reads per request; default and at most max_seq_len),
`max_gen_toks` (256), `add_bos_token` and `prefix_token_id` (as lm-eval's `hf` model: see
below) and `seed` (0: for sampled generation).

On the same checkpoint this adapter gives the numbers of lm-eval's own transformers model
(`--model hf`, `HFLM`), quirks included, so that they compare with published ones:
- Tokenizer: where the tokenizer directory holds transformers' files (`tokenizer_config.json`
  or `tokenizer.json`), it is transformers' `AutoTokenizer`, as `hf` reads it (this can differ
  from SentencePiece itself: transformers' LLaMA tokenizer does not double the leading space of
  a text that starts with one). Otherwise llama_jax's `tokenizer.model`, whose default is the
  LLaMA family's: BOS, no EOS.
- Encoding (`tok_encode`): the tokenizer's default special tokens, or `add_bos_token` when
  given; a text that already starts with the prefix token's text (`<s>`) gets no second one.
- loglikelihood: lm-eval's `TemplateLM` pairs: the context encoded with BOS (an empty context
  is the prefix token alone), its trailing spaces moved onto the continuation, and the
  continuation the tokens of context + continuation past the context's own; `scoring.score`
  reads the last `max_length` + 1 tokens, as `hf` truncates long requests from the left.
- loglikelihood_rolling: the text encoded as above, so with BOS, and cut into lm-eval's
  rolling windows of `max_length` predictions, the first conditioned on the prefix token
  (`prefix_token_id`, default BOS): `hf` scores log p(BOS | BOS) too, and so do we. A
  document's windows are summed.
- generate_until: the context encoded as above, left-truncated to `max_length - max_gen_toks`
  tokens, through the KV-cached decoder a batch at a time. Greedy unless the request samples
  (lm-eval's `normalize_gen_kwargs`: `do_sample`, or a positive temperature; top_k, top_p and
  min_p are honoured; transformers would add its generation defaults, e.g. top_k 50, which we
  do not). Decoding stops at the model's EOS ids and once every row of the batch has produced
  a stop string (the request's `until` and the EOS token's text). As `hf`, the new tokens are
  decoded alone, special tokens skipped (so SentencePiece drops the space of the first
  piece), and cut at the first stop string.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Sequence

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                      postprocess_generated_text)
    from lm_eval.utils import (get_rolling_token_windows, make_disjoint_window,
                               simple_parse_args_string)
except ImportError:
    raise ImportError("llama_jax.eval.harness needs lm-eval: pip install 'llama_jax[eval]'"
                      ) from None

from llama_jax.formats.checkpoint import load_checkpoint
from llama_jax.decode.decoder import release_decoder_copy
from llama_jax.decode.generate import stream
from llama_jax.eval.scoring import score
from llama_jax.data.tokenizer import Tokenizer, load_tokenizer

MODEL_NAME = "llama_jax"
SAMPLING_KWARGS = ("top_k", "top_p", "min_p")
# transformers' tokenizer files: where they are, lm-eval's hf model reads them.
HF_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
# Decode steps between checks of the stop strings: each check is a host round trip.
STOP_CHECK_STEPS = 16


class HFTokens:
    """A transformers tokenizer, called as lm-eval's hf model calls it."""

    reads_special_text = True  # "<s>" in a text encodes as BOS

    def __init__(self, path: Path):
        try:
            import transformers
        except ImportError:
            raise ImportError(f"{path} holds a transformers tokenizer: reading it needs "
                              "transformers (pip install transformers)") from None
        self._tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.bos_id = self._tokenizer.bos_token_id
        self.eos_id = self._tokenizer.eos_token_id

    def encode(self, text: str, add_special_tokens: bool | None) -> list[int]:
        """With the tokenizer's own special tokens when `add_special_tokens` is None."""
        flags = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self._tokenizer.encode(text, **flags)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def text_of(self, token: int) -> str:
        return self._tokenizer.decode([token])


class OwnTokens:
    """A llama_jax tokenizer (`tokenizer.model`) behind the same calls."""

    reads_special_text = False  # special tokens' text encodes as ordinary text

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.bos_id = tokenizer.bos_id
        self.eos_id = tokenizer.eos_ids[0]

    def encode(self, text: str, add_special_tokens: bool | None) -> list[int]:
        """With the LLaMA family's default (BOS) when `add_special_tokens` is None."""
        return self._tokenizer.encode(text, bos=add_special_tokens is not False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([i for i in ids if i not in self._tokenizer.special_ids])

    def text_of(self, token: int) -> str:
        return self._tokenizer.decode([token])


def load_tokens(path: str | Path) -> HFTokens | OwnTokens:
    """transformers' tokenizer where `path` (a directory) holds its files, else llama_jax's."""
    path = Path(path)
    if path.is_dir() and any((path / name).is_file() for name in HF_TOKENIZER_FILES):
        return HFTokens(path)
    return OwnTokens(load_tokenizer(path))


class LlamaJaxLM(TemplateLM):
    """A llama_jax checkpoint behind lm-eval's `LM` interface (see the module docstring).
    `max_batch_size` and `device`, which lm-eval passes to every model, are not used: the batch
    size is fixed and JAX places arrays on its default device."""

    def __init__(self, checkpoint: str, tokenizer: str | None = None, dtype: str | None = None,
                 quantize: str | None = None, cache_dtype: str | None = None,
                 batch_size: int | str = 8, max_length: int | str | None = None,
                 max_gen_toks: int | str = 256, add_bos_token: bool | str | None = None,
                 prefix_token_id: int | str | None = None, seed: int | str = 0,
                 max_batch_size: int | None = None, device: str | None = None):
        super().__init__()
        self.config, self.params = load_checkpoint(checkpoint, dtype, quantize=quantize)
        self.cache_dtype = cache_dtype
        self.tokens = load_tokens(checkpoint if tokenizer is None else tokenizer)
        self.batch_size = _integer("batch_size", batch_size)
        self.max_length = (self.config.max_seq_len if max_length is None
                           else _integer("max_length", max_length))
        if self.max_length > self.config.max_seq_len:
            raise ValueError(f"max_length={self.max_length} exceeds the model's context "
                             f"(max_seq_len {self.config.max_seq_len})")
        self.max_gen_toks = _integer("max_gen_toks", max_gen_toks)
        self.add_bos_token = _optional_bool("add_bos_token", add_bos_token)
        self.custom_prefix_token_id = (
            None if prefix_token_id is None
            else _integer("prefix_token_id", prefix_token_id, at_least=0))
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
        return self.tokens.eos_id

    @property
    def prefix_token_id(self) -> int:
        """As lm-eval's hf model: the `prefix_token_id` argument, else BOS, else EOS."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        return self.tokens.bos_id if self.tokens.bos_id is not None else self.tokens.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs
                   ) -> list[int]:
        """As lm-eval's hf model: `add_special_tokens`, else `add_bos_token`, else the
        tokenizer's default; none when the text starts with the prefix token's text."""
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if (add_special_tokens is None and self.tokens.reads_special_text
                and string.startswith(self.tokens.text_of(self.prefix_token_id))):
            special = False
        return self.tokens.encode(string, special)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        scores = score(self.config, self.params, [context for _, context, _ in requests],
                       [continuation for _, _, continuation in requests],
                       batch_size=self.batch_size, max_len=self.max_length,
                       cache_dtype=self.cache_dtype)
        return [(s.logprob, s.greedy) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        contexts, continuations, owners = [], [], []
        for i, (text,) in enumerate(request.args for request in requests):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                contexts.append(context)
                continuations.append(continuation)
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, s in zip(owners, score(self.config, self.params, contexts, continuations,
                                      batch_size=self.batch_size, max_len=self.max_length,
                                      cache_dtype=self.cache_dtype)):
            totals[i] += s.logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their generation settings, longest context first in each."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        texts: list[str] = [""] * len(requests)
        try:
            for indices in groups.values():
                indices.sort(key=lambda i: -len(requests[i].args[0]))
                for start in range(0, len(indices), self.batch_size):
                    batch = indices[start:start + self.batch_size]
                    outputs = self._generate([requests[i].args[0] for i in batch],
                                             requests[batch[0]].args[1])
                    for i, text in zip(batch, outputs):
                        texts[i] = text
        finally:  # scoring reads the stacked weights: the decoder's copy would only take room
            release_decoder_copy()
        return texts

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        until, max_new, sampling = _generation_settings(
            gen_kwargs, self.max_gen_toks, self.tokens.text_of(self.eot_token_id))
        max_context = self.max_length - max_new
        if max_context < 1:
            raise ValueError(f"max_gen_toks={max_new} leaves no room for a context in "
                             f"max_length={self.max_length} tokens")
        prompts = [self.tok_encode(context)[-max_context:] for context in contexts]
        stops = self.config.stop_ids or (self.eot_token_id,)
        new: list[list[int]] = [[] for _ in prompts]
        for chunk, _ in stream(self.config, self.params, prompts, max_new, seed=self.seed,
                               stop_tokens=stops, chunk_steps=STOP_CHECK_STEPS,
                               cache_dtype=self.cache_dtype, **sampling):
            new = [row + tokens for row, tokens in zip(new, chunk)]
            if all(any(stop in self.tokens.decode(row) for stop in until) for row in new):
                break  # the rest of the stream is never computed
        return [postprocess_generated_text(self.tokens.decode(row), until, None) for row in new]


def _generation_settings(gen_kwargs: dict, max_gen_toks: int, eos_text: str
                         ) -> tuple[list[str], int, dict]:
    """(stop strings, max new tokens, `stream` sampling arguments) from lm-eval's gen_kwargs,
    read by lm-eval's own `normalize_gen_kwargs` (greedy unless do_sample, or unset with a
    positive temperature) and `handle_stop_sequences` (which adds the EOS token's text)."""
    kwargs = dict(normalize_gen_kwargs(gen_kwargs, max_gen_toks))
    until = handle_stop_sequences(kwargs.pop("until"), eos=eos_text)
    until = [stop for stop in until if stop]
    max_new = _integer("max_gen_toks", kwargs.pop("max_gen_toks"))
    do_sample, temperature = kwargs.pop("do_sample"), float(kwargs.pop("temperature", 0.0))
    if do_sample and temperature <= 0:
        raise ValueError(f"do_sample with temperature={temperature}: sampling needs a positive "
                         "temperature (transformers refuses it too)")
    sampling = {"temperature": temperature if do_sample else 0.0}
    sampling.update((name, kwargs.pop(name)) for name in SAMPLING_KWARGS if name in kwargs)
    if kwargs:
        raise ValueError(f"generation kwargs {sorted(kwargs)} are not supported; llama_jax "
                         f"reads until, max_gen_toks, do_sample, temperature, "
                         f"{', '.join(SAMPLING_KWARGS)}")
    return until, max_new, sampling


def _integer(name: str, value, at_least: int = 1) -> int:
    """An integer model argument (lm-eval may pass it as a string)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise ValueError(f"{name}={value!r} must be an integer >= {at_least}")
    return value


def _optional_bool(name: str, value) -> bool | None:
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be true or false")
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
