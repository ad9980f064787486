"""Which grammar library constrained decoding uses: llguidance against outlines-core, on the
same vocabularies, schemas and token walks, in one process.

    python bench/grammar.py [--rounds 3] [--gguf FILE] [--decode CKPT] [--serve CKPT]
                            [--no-libraries]

Vocabularies: SmolLM2-135M's byte-level BPE (49,152 tokens, from the GGUF `make chat`
fetches), LLaMA 3's tiktoken BPE (128,256, from the llama-models package) and a SentencePiece
model with byte fallback (8,192, trained here on the demo corpus, as `make demo` trains one).
Each library gets the tokens as bytes from our tokenizers (llama_jax.decode.grammar's
Vocabulary for llguidance; outlines-core's Vocabulary of the same bytes).

Measured, per library and vocabulary:
- vocabulary: building the library's view of the tokenizer (once per tokenizer);
- compile: a 20-property JSON schema to a matcher ready for its first mask (median of the
  rounds, each on a fresh copy of the schema so no cache answers);
- mask: the median time to fill one row's packed mask, at every token of a valid instance of
  that schema (tokenized by the longest match of the tokens' bytes);
- coverage: of a list of JSON-Schema features, those that compile and accept a valid
  instance.

With `--decode CHECKPOINT` (the demo model, `make demo`), the cost of constraining in
`generate`: a batch of 8 prompts decoded free (one program for the whole decode), free one
step per program (the host round trip a constrained batch takes per token) and under a
JSON schema; rounds alternate, medians of the time per decode step of the batch. With
`--serve CHECKPOINT`, the same in a server: 8 chat requests at once, free against under the
schema (`response_format`), tokens per second. Its summary is made longer than the answers
may be, so that every row decodes its 64 tokens, as the free ones do: rows that finish early
leave their slots idle while the longest runs, which costs tokens/s but not the mask.
`--no-libraries` measures those costs alone (a lent GPU: `bash bench/lease.sh grammar`),
without the libraries' table and its vocabularies.

Prints tables; BENCHMARKS.md records them.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_GGUF = Path.home() / ".cache" / "llama_jax" / "SmolLM2-135M-Instruct.Q4_1.gguf"

# 20 properties: strings, bounded numbers, enums, arrays, a nested object, an optional field
SCHEMA_20 = {"type": "object", "additionalProperties": False, "properties": {
    **{f"name{i}": {"type": "string", "maxLength": 16} for i in range(5)},
    **{f"count{i}": {"type": "integer", "minimum": 0, "maximum": 1000} for i in range(4)},
    "price": {"type": "number"}, "ok": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "scores": {"type": "array", "items": {"type": "integer"}},
    "where": {"type": "object", "properties": {"lat": {"type": "number"},
                                               "lon": {"type": "number"}},
              "required": ["lat", "lon"]},
    "when": {"type": "string", "format": "date"},
    "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "note": {"type": ["string", "null"]},
    "level": {"type": "integer", "enum": [1, 2, 3]},
    "extra": {"type": "string"}},
    "required": [*(f"name{i}" for i in range(5)), *(f"count{i}" for i in range(4)), "price",
                 "ok", "color", "tags", "scores", "where", "when", "id", "note", "level"]}
INSTANCE_20 = {**{f"name{i}": f"item {i}" for i in range(5)},
               **{f"count{i}": 10 * i + 3 for i in range(4)}, "price": 12.5, "ok": True,
               "color": "green", "tags": ["a", "b"], "scores": [3, 1, 4],
               "where": {"lat": 47.37, "lon": 8.54}, "when": "2026-11-28", "id": "ABC-1234",
               "note": None, "level": 2}

# (feature, schema, a valid instance)
COVERAGE = [
    ("$ref/$defs", {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}},
                                    "required": ["x"]}},
                    "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}},
                    "required": ["a"]}, {"a": {"x": 1}}),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                          "required": ["a"]},
                         {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     {"a": 1, "b": "x"}),
    ("enum + const", {"type": "object", "properties": {"e": {"enum": ["x", 2]},
                                                       "c": {"const": "k"}},
                      "required": ["e", "c"]}, {"e": 2, "c": "k"}),
    ("string pattern", {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}, "ab@cd.com"),
    ("string format date-time", {"type": "string", "format": "date-time"},
     "2026-11-28T21:00:00Z"),
    ("minLength/maxLength", {"type": "string", "minLength": 3, "maxLength": 5}, "abcd"),
    ("integer range", {"type": "integer", "minimum": 10, "maximum": 20}, 15),
    ("number exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 0.5),
    ("array min/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                            "maxItems": 3}, [1, 2]),
    ("array prefixItems", {"type": "array", "prefixItems": [{"type": "string"},
                                                            {"type": "integer"}]}, ["a", 1]),
    ("additionalProperties schema", {"type": "object",
                                     "additionalProperties": {"type": "integer"}},
     {"k": 1}),
    ("nested arrays of objects", {"type": "array", "items": {
        "type": "object", "properties": {"v": {"type": "array", "items": {"type": "number"}}},
        "required": ["v"]}}, [{"v": [1.5, 2]}]),
    ("type list", {"type": ["integer", "null"]}, None),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["kids"]}},
        "$ref": "#/$defs/node"}, {"kids": [{"kids": []}]}),
]


def tokenizers(gguf: Path) -> dict:
    """name -> one of our tokenizers."""
    import glob

    import llama_jax

    found = {}
    if gguf.is_file():
        found["byte-level BPE (SmolLM2, 49K)"] = llama_jax.load_tokenizer(gguf)
    try:
        import llama_models
        found["tiktoken (LLaMA 3, 128K)"] = llama_jax.load_tokenizer(
            Path(llama_models.__file__).parent / "llama3" / "tokenizer.model")
    except ImportError:
        pass
    demo = sorted(glob.glob(str(Path.home() / ".cache/llama_jax/tokens/*/tokenizer.model")))
    if demo:
        found["SentencePiece, byte fallback (demo, 8K)"] = llama_jax.load_tokenizer(demo[0])
    return found


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        from llama_jax.decode.grammar import vocabulary

        self.vocab = vocabulary(tokenizer, tokenizer.vocab_size, tokenizer.eos_ids[:1])

    def matcher(self, schema: dict):
        from llama_jax.decode.grammar import Grammar, Matcher

        return Matcher(Grammar.json_schema(schema), self.vocab)

    def fill(self, matcher, words: np.ndarray) -> None:
        matcher.fill(words)

    def accept(self, matcher, token: int) -> bool:
        before = matcher.valid_prefix([token])
        if before:
            matcher.accept(token)
        return bool(before)

    def tokens(self, text: str) -> list[int]:
        return self.vocab.lltokenizer.tokenize_str(text)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer):
        from outlines_core import Vocabulary

        eos = tokenizer.eos_ids[0]
        by_bytes: dict[bytes, list[int]] = {}
        for i in range(tokenizer.vocab_size):
            piece = tokenizer.token_bytes(i)
            if piece and i not in tokenizer.special_ids:
                by_bytes.setdefault(piece, []).append(i)
        self.vocabulary = Vocabulary(eos, by_bytes)
        self.reference = Llguidance(tokenizer)  # the same longest-match token walk

    def matcher(self, schema: dict):
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema

        return Guide(Index(build_regex_from_schema(json.dumps(schema)), self.vocabulary))

    def fill(self, guide, words: np.ndarray) -> None:
        guide.write_mask_into(words.ctypes.data, words.size, 4)

    def accept(self, guide, token: int) -> bool:
        try:
            guide.advance(token)
            return True
        except Exception:  # outlines-core raises for a token its automaton does not take
            return False

    def tokens(self, text: str) -> list[int]:
        return self.reference.tokens(text)


def measure(library, tokenizer, rounds: int) -> dict:
    words = np.zeros(-(-tokenizer.vocab_size // 32), np.int32)
    compile_s = []
    for r in range(rounds):
        schema = copy.deepcopy(SCHEMA_20)
        schema["properties"]["extra"]["description"] = f"round {r}"  # no cache answers
        start = time.perf_counter()
        matcher = library.matcher(schema)
        library.fill(matcher, words)
        compile_s.append(time.perf_counter() - start)
    mask_s, walked = [], 0
    for token in library.tokens(json.dumps(INSTANCE_20)):
        start = time.perf_counter()
        library.fill(matcher, words)
        mask_s.append(time.perf_counter() - start)
        if not library.accept(matcher, token):
            break
        walked += 1
    covered = []
    for feature, schema, instance in COVERAGE:
        try:
            m = library.matcher(schema)
            ok = all(library.accept(m, t) for t in library.tokens(json.dumps(instance)))
        except Exception:
            ok = False
        covered.append(feature if ok else f"-{feature}")
    return {"compile_ms": 1e3 * statistics.median(compile_s),
            "mask_us": 1e6 * statistics.median(mask_s), "walked": walked,
            "instance_tokens": len(library.tokens(json.dumps(INSTANCE_20))),
            "covered": covered}


DECODE_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40}, "summary": {"type": "string", "maxLength": 160},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5}},
    "required": ["title", "summary", "tags"], "additionalProperties": False}
PROMPTS = ["The os module", "How to read a file", "Classes in Python", "The json module",
           "Regular expressions", "Threads and processes", "The logging module", "Decorators"]


def decode_costs(checkpoint: str, rounds: int, max_new: int = 64) -> None:
    """Milliseconds per decode step of a batch of 8: free, free one step a program,
    constrained (a step is one token of every row still going)."""
    import llama_jax

    config, params = llama_jax.load_checkpoint(checkpoint)
    tokenizer = llama_jax.load_tokenizer(checkpoint)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    cases = {"free, one program": dict(chunk_steps=None),
             "free, one step a program": dict(chunk_steps=1),
             "json schema (one step a program, masks)": dict(json_schema=DECODE_SCHEMA,
                                                            tokenizer=tokenizer)}
    per_step: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds + 1):  # the first round compiles
        for name, extra in cases.items():
            start, steps, longest = time.perf_counter(), 0, [0] * len(prompts)
            for chunk, _ in llama_jax.stream(config, params, prompts, max_new,
                                             temperature=0.7, seed=r, **extra):
                steps += 1
                longest = [n + len(t) for n, t in zip(longest, chunk)]
            if r:  # one program: as many steps as the longest row took
                steps = max(longest) if extra.get("chunk_steps", 1) is None else steps
                per_step[name].append((time.perf_counter() - start) / steps)
    print_medians("batch 8, demo model | ms per step", "free, one step a program",
                  {name: [1e3 * t for t in times] for name, times in per_step.items()},
                  rates=False)


def serve_costs(checkpoint: str, rounds: int, max_new: int = 64) -> None:
    """Tokens per second of one server (`python -m llama_jax.serve`, 8 slots) answering 8
    chat requests at once, free against under a JSON schema (`response_format`), rounds
    alternating; medians."""
    import asyncio

    import openai

    from serve import Server, free_port

    port = free_port()
    server = Server([sys.executable, "-m", "llama_jax.serve", "--checkpoint", checkpoint,
                     "--port", str(port), "--served-model-name", "bench", "--max-batch", "8",
                     "--log-level", "warning"], port, "serving bench on ")
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                             max_retries=0, timeout=600)
    schema = copy.deepcopy(DECODE_SCHEMA)  # no answer ends before its max_tokens
    schema["properties"]["summary"] = {"type": "string", "minLength": 400}
    formats = {"free": None, "json schema": {"type": "json_schema", "json_schema": {
        "name": "doc", "schema": schema}}}

    async def burst(response_format, seed: int) -> float:
        start = time.perf_counter()
        replies = await asyncio.gather(*(api.chat.completions.create(
            model="bench", messages=[{"role": "user", "content": p}], max_tokens=max_new,
            temperature=0.7, seed=seed + i, **({"response_format": response_format}
                                               if response_format else {}))
            for i, p in enumerate(PROMPTS)))
        return sum(r.usage.completion_tokens for r in replies) / (time.perf_counter() - start)

    rates: dict[str, list[float]] = {name: [] for name in formats}

    async def measure() -> None:
        for r in range(rounds + 1):  # the first round compiles the masked programs
            for name, response_format in formats.items():
                rate = await burst(response_format, r)
                if r:
                    rates[name].append(rate)

    try:
        asyncio.run(measure())
    finally:
        server.stop()
    print_medians("server, 8 chat requests at once, demo model | tokens/s", "free", rates,
                  rates=True)


def print_medians(head: str, base: str, values: dict[str, list[float]], rates: bool) -> None:
    """A table of each case's median and its speed against case `base` (`rates`: the values
    are rates, higher is faster; else times)."""
    medians_ = {name: statistics.median(v) for name, v in values.items()}
    print(f"| {head} | vs {base} |")
    print("|---|---|---|")
    for name, m in medians_.items():
        ratio = m / medians_[base] if rates else medians_[base] / m
        print(f"| {name} | {m:.2f} | {ratio:.2f}x |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--decode", metavar="CHECKPOINT",
                        help="also measure constrained decoding's cost on this checkpoint")
    parser.add_argument("--serve", metavar="CHECKPOINT",
                        help="also measure a server's tokens/s under a JSON schema")
    parser.add_argument("--no-libraries", action="store_true",
                        help="skip the libraries' comparison (with --decode / --serve)")
    args = parser.parse_args()
    if args.decode:
        decode_costs(args.decode, args.rounds)
    if args.serve:
        serve_costs(args.serve, args.rounds)
    if args.no_libraries:
        return 0
    print("| vocabulary | library | vocabulary build | 20-property schema compile | "
          "mask per token | valid instance walked | coverage |")
    print("|---|---|---|---|---|---|---|")
    missed = {}
    for vocab_name, tokenizer in tokenizers(args.gguf).items():
        for library_class in (Llguidance, OutlinesCore):
            start = time.perf_counter()
            library = library_class(tokenizer)
            build_s = time.perf_counter() - start
            try:
                r = measure(library, tokenizer, args.rounds)
            except Exception as e:  # a library that cannot take this vocabulary or schema
                print(f"| {vocab_name} | {library.name} | {build_s:.2f} s | failed: "
                      f"{' '.join(str(e).split())[:120]} | | | |")
                continue
            n_ok = sum(not c.startswith("-") for c in r["covered"])
            missed[library.name] = [c[1:] for c in r["covered"] if c.startswith("-")]
            print(f"| {vocab_name} | {library.name} | {build_s:.2f} s | "
                  f"{r['compile_ms']:,.1f} ms | {r['mask_us']:,.0f} µs | "
                  f"{r['walked']}/{r['instance_tokens']} | {n_ok}/{len(COVERAGE)} |")
    for name, features in missed.items():
        print(f"{name} misses: {', '.join(features) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
