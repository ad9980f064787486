"""Sample continuations from any checkpoint llama_jax reads (HF, Meta, GGUF, native), or chat
with it.

    python sample.py --checkpoint DIR --prompt "Once upon a time" [--prompt ...]
                     [--prompt-file FILE] [--max-new-tokens 128] [--temperature 0.6]
                     [--top-k 0] [--top-p 0.9] [--min-p 0] [--seed 0] [--dtype bfloat16]
                     [--quantize int8 [--quantize-head]] [--cache-dtype int8]
                     [--speculate ngram | --draft-checkpoint DIR] [--num-speculative-tokens 4]
                     [--json-schema FILE | --regex PATTERN]

    python sample.py --checkpoint MODEL.gguf --chat [--system "You are ..."] [--json-schema FILE]

`--chat` reads one user message per line from stdin and streams each answer, keeping the
conversation: every turn is rendered with the checkpoint's own chat template (LLaMA 3's or
LLaMA 2's format when it has none) and ends at an end-of-turn token. An empty line is skipped;
end of input ends the chat.

A single prompt streams to stdout as it is generated (decoded in chunks of --chunk-steps
steps); several prompts run as one ragged batch and print when done. Time to first token,
tokens/s and compile time go to stderr, and so do the library's notes (`note: ...`: the
decoder `--decode-impl auto` fell back to).

Speculative decoding gives the same output (greedy: the same tokens; sampled: the same
distribution) in fewer target passes: `--speculate ngram` guesses by prompt lookup (for output
that repeats its input: summaries, edits, quotes), `--draft-checkpoint DIR` by a small model
sharing the tokenizer. The acceptance rate goes to stderr with the timings.

`--json-schema FILE` and `--regex PATTERN` constrain the output (llama_jax.decode.grammar):
every token is chosen among those that keep it a JSON value of the schema (written as
`json.dumps` writes it) or a match of the pattern, and the output ends where the grammar does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llama_jax import load_checkpoint, load_tokenizer
from llama_jax.cli import (add_int8_arguments, add_speculation_arguments, show_library_notes,
                           user_errors_exit)
from llama_jax.config import DTYPES
from llama_jax.nn.attention.dot_product import ATTENTION_IMPLS
from llama_jax.decode.decoder import DECODE_IMPLS, owned_decoder_params
from llama_jax.decode.generate import GenerationStats, stream
from llama_jax.decode.grammar import Grammar
from llama_jax.decode.speculate import MAX_GUESSES, METHODS
from llama_jax.errors import GenerateError
from llama_jax.data.chat import chat_format
from llama_jax.data.tokenizer import TextStream


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory")
    parser.add_argument("--tokenizer", help="tokenizer.model (default: the checkpoint's)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompt-file", help="a file with one prompt per non-empty line")
    parser.add_argument("--chat", action="store_true",
                        help="chat: user messages from stdin, one per line, answers streamed "
                             "in the checkpoint's chat template")
    parser.add_argument("--system", help="with --chat: a system message first")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=0.9, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="parameter and compute dtype (default: as stored)")
    add_int8_arguments(parser, cache_default="the compute dtype")
    parser.add_argument("--decode-impl", choices=DECODE_IMPLS, default="auto",
                        help="layers as a scan over stacked weights, or an unrolled loop over "
                             "per-layer weights (auto: unrolled on CPU and GPU when the per-layer "
                             "copy fits, scan on TPU)")
    parser.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default="auto",
                        help="how the prompt's attention is computed (auto: chunked on CPU, "
                             "cuDNN on GPUs, splash on TPUs); decode steps use one query")
    parser.add_argument("--chunk-steps", type=int, default=8,
                        help="decode steps (speculative rounds) between prints when streaming")
    add_speculation_arguments(parser, "speculative decoding: ngram (prompt lookup) or draft (a "
                                      "draft model, --draft-checkpoint; implied by it)",
                              METHODS, MAX_GUESSES)
    parser.add_argument("--json-schema", metavar="FILE",
                        help="constrain the output to JSON of this schema (a JSON file)")
    parser.add_argument("--regex", help="constrain the output to match this regular expression")
    parser.add_argument("--draft-checkpoint",
                        help="a draft model's checkpoint (sharing the tokenizer), loaded as "
                             "--dtype and --quantize say")
    return parser.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            lines = Path(args.prompt_file).read_text().splitlines()
        except OSError as e:
            raise GenerateError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise GenerateError("no prompt: give --prompt TEXT or --prompt-file FILE")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise GenerateError(f"prompt {i} is empty")
    return prompts


def sampling(args: argparse.Namespace) -> dict:
    """`stream`'s sampling settings and cache dtype, as the flags give them."""
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, cache_dtype=args.cache_dtype)


def constraint(args: argparse.Namespace, tokenizer) -> dict:
    """`stream`'s grammar settings from --json-schema and --regex (checked before anything
    compiles: a bad file or schema is one line naming it)."""
    if args.json_schema and args.regex:
        raise GenerateError("give --json-schema or --regex, not both")
    if args.regex:
        grammar = Grammar.regex(args.regex).checked()
    elif args.json_schema:
        try:
            grammar = Grammar.json_schema(Path(args.json_schema).read_text()).checked()
        except OSError as e:
            raise GenerateError(f"--json-schema {args.json_schema}: {e.strerror}") from None
        except GenerateError as e:
            raise GenerateError(f"--json-schema {args.json_schema}: {e}") from None
    else:
        return {}
    return dict(grammar=grammar, tokenizer=tokenizer)


def chat(args: argparse.Namespace, config, params, tokenizer, decode_impl: str,
         constrained: dict) -> int:
    """The `--chat` loop: a turn per stdin line, each answer streamed and kept."""
    render = chat_format(args.checkpoint, tokenizer)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turn = 0
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        text, answer = TextStream(tokenizer), []
        for new_tokens, _ in stream(config, params, [render(messages)], args.max_new_tokens,
                                    **sampling(args), **constrained, seed=args.seed + turn,
                                    decode_impl=decode_impl, chunk_steps=args.chunk_steps):
            answer += new_tokens[0]
            print(text.push(new_tokens[0]), end="", flush=True)
        print(text.flush(), flush=True)
        messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
        turn += 1


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    show_library_notes()
    if args.chat and (args.prompt or args.prompt_file or args.speculate or args.draft_checkpoint):
        raise GenerateError("--chat takes its messages from stdin: leave out --prompt, "
                            "--prompt-file and speculation")
    prompts = [] if args.chat else read_prompts(args)
    tokenizer = load_tokenizer(args.tokenizer or args.checkpoint)
    constrained = constraint(args, tokenizer)
    config, params = load_checkpoint(args.checkpoint, args.dtype, quantize=args.quantize,
                                     quantize_head=args.quantize_head)
    config = config.with_execution(attention_impl=args.attention_impl)
    params, decode_impl = owned_decoder_params(params, args.decode_impl)  # one copy held
    if args.chat:
        return chat(args, config, params, tokenizer, decode_impl, constrained)
    draft = None
    if args.draft_checkpoint:
        draft_config, draft_params = load_checkpoint(args.draft_checkpoint, args.dtype,
                                                     quantize=args.quantize,
                                                     quantize_head=args.quantize_head)
        draft = (draft_config, owned_decoder_params(draft_params, decode_impl)[0])
    token_prompts = [tokenizer.encode(p, bos=True) for p in prompts]
    stats = GenerationStats()
    streaming = len(prompts) == 1
    text = TextStream(tokenizer, token_prompts[0])
    generated: list[list[int]] = [[] for _ in prompts]
    chunks = stream(config, params, token_prompts, args.max_new_tokens, **sampling(args),
                    seed=args.seed, decode_impl=decode_impl,
                    chunk_steps=args.chunk_steps if streaming else None, stats=stats,
                    speculate=args.speculate, num_speculative_tokens=args.num_speculative_tokens,
                    ngram=tuple(args.ngram), draft=draft, **constrained)
    for i, (new_tokens, _) in enumerate(chunks):
        for row, tokens in zip(generated, new_tokens):
            row += tokens
        if streaming:  # the prompt only once the request is accepted and the first token is in
            print((prompts[0] if i == 0 else "") + text.push(new_tokens[0]), end="", flush=True)
    if streaming:
        print(text.flush())
    else:
        for i, (prompt, context, tokens) in enumerate(zip(prompts, token_prompts, generated)):
            continuation = TextStream(tokenizer, context)
            print(f"--- prompt {i} ---\n{prompt}{continuation.push(tokens)}"
                  f"{continuation.flush()}\n")
    speculation = ""
    if args.speculate or draft:
        speculation = (f"; {stats.accepted_tokens} of {stats.drafted_tokens} guesses accepted "
                       f"({stats.acceptance_rate:.0%})")
    print(f"[{stats.new_tokens} tokens in {len(prompts)} row(s); time to first token "
          f"{stats.time_to_first_token_s * 1e3:.1f} ms; {stats.tokens_per_s:.1f} tokens/s; "
          f"compile {stats.compile_s:.1f} s{speculation}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
