"""Grammars for constrained decoding: which tokens may come next in a row, so that what it
generates is valid by construction.

    grammar = Grammar.json_schema({"type": "object", "properties": {...}})   # or .regex(...),
    tokens = generate(config, params, prompts, 64, grammar=grammar,          # .lark(...),
                      tokenizer=tokenizer)                                    # .json_object()

A grammar is compiled by llguidance (bench/grammar.py measured it against outlines-core: it
compiles a 20-property schema in 2 ms where outlines-core's up-front automaton over the
vocabulary takes 0.1 to 3.4 s, fills a mask in about 10 µs, and covers more of JSON Schema)
against a `Vocabulary`: the tokenizer's tokens as bytes (`Tokenizer.token_bytes`, so
SentencePiece with byte fallback, tiktoken and byte-level BPE alike; control tokens by name,
marked special, so a grammar never produces one by accident) and the ids that end a row. Built
once per tokenizer and set of ending ids (under a second for 128K tokens), then cached.

A row's `Matcher` follows the tokens chosen and fills, before each step, its row of the packed
mask: int32 words `[W = ceil(V / 32)]`, bit `v % 32` of word `v // 32` set where token v is
allowed (`allowed` unpacks it on the device). Ids past the tokenizer's vocabulary (a model's
padded embedding rows) are never allowed. Where the grammar is complete (accepting), the
ending ids are allowed too; where it cannot go on, only they are, so a row whose grammar has
ended stops.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.data.tokenizer import Tokenizer
from llama_jax.data.tool_calls import ToolFormat
from llama_jax.errors import GenerateError

ALL_ALLOWED = -1  # a mask word with every bit set: a row without a grammar
# llguidance's mark of a special token's text (its bytes otherwise never start with 0xFF)
_SPECIAL = b"\xff"
# JSON written as `json.dumps` writes it (what OpenAI's models write): ", " and ": " between
# items, no other whitespace. A model left free to add whitespace may add it forever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a tool's arguments by default


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a row's output must match: `kind` is json_schema (the schema as JSON text), regex
    or lark (a Lark grammar, llguidance's dialect)."""

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        """Output that is a JSON value of this schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GenerateError(f"json schema: not JSON ({e})") from None
        if not isinstance(schema, dict):
            raise GenerateError(f"json schema: must be a JSON object, got "
                                f"{type(schema).__name__}")
        # in its own order: properties are generated in the order the schema lists them
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        return cls("lark", grammar)

    def checked(self) -> Grammar:
        """The grammar, once llguidance found no error in it, before any vocabulary: a
        GenerateError saying what is wrong (as a Matcher of it would)."""
        _validated(self, None)
        return self

    def describe(self) -> str:
        return {"json_schema": "json schema", "regex": "regex", "lark": "grammar"}[self.kind]


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GenerateError("constrained decoding needs llguidance: pip install llguidance "
                            "(a dependency of llama_jax)") from None
    return llguidance


class Vocabulary:
    """A tokenizer's tokens as llguidance sees them, padded to the model's `vocab_size`, and
    the ids that end a row (`stop_ids`)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        llguidance = _llguidance()
        self.vocab_size, self.stop_ids = vocab_size, tuple(stop_ids)
        n = min(tokenizer.vocab_size, vocab_size)
        # Control tokens by name. A token of no text (SentencePiece's unknown), the ids past the
        # tokenizer, and a byte-fallback token of byte 0xFF (llguidance's special mark, which
        # valid UTF-8 never holds) by a name of their own: so no token is empty or ambiguous.
        names = {i: name for name, i in tokenizer.special_tokens.items()}
        tokens = [None if i in names else tokenizer.token_bytes(i) for i in range(n)]
        names |= {i: f"<[{i}]>" for i in range(vocab_size) if i >= n or i not in names and (
            not tokens[i] or tokens[i].startswith(_SPECIAL))}
        tokens = [_SPECIAL + names[i].encode() if i in names else tokens[i]
                  for i in range(vocab_size)]
        self.words = -(-vocab_size // 32)
        self.lltokenizer = llguidance.LLTokenizer(
            _Wrapped(tokenizer, tokens, sorted(names), self.stop_ids[0]),
            n_vocab=vocab_size, eos_token=list(self.stop_ids))


class _Wrapped:
    """The shape llguidance's `TokenizerWrapper` reads a tokenizer in. Its tokenization (of
    the grammar's literal text, to force tokens) is the longest match of the tokens' bytes:
    the tokenizer's own may change the text (SentencePiece's dummy prefix adds a space), and
    any split of the bytes into tokens is one the grammar reads as the same text."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], special: list[int],
                 eos_id: int):
        self.tokens, self.special_token_ids, self.eos_token_id = tokens, special, eos_id
        self.bos_token_id = tokenizer.bos_id
        self.is_tokenizer_wrapper = True
        specials = set(special)
        self._ids = {t: i for i, t in enumerate(tokens) if i not in specials}
        self._longest = max(map(len, self._ids))

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        ids, at = [], 0
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                if data[at:at + n] in self._ids:
                    ids.append(self._ids[data[at:at + n]])
                    at += n
                    break
            else:  # a byte no token holds: not text this vocabulary can write
                return ids
        return ids


# Vocabularies by tokenizer object (dropped with it), then by (vocab_size, stop ids)
_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary(tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> Vocabulary:
    """The (cached) Vocabulary of `tokenizer` for a model of `vocab_size` ending rows at
    `stop_ids` (at least one)."""
    if not stop_ids or min(stop_ids) < 0:  # no stop id, or the stop table's "none"
        raise GenerateError("constrained decoding needs a stop token to end a row whose "
                            "grammar is complete (neither the model nor the tokenizer has an "
                            "EOS id: give stop_tokens)")
    kept = _VOCABULARIES.setdefault(tokenizer, {})
    key = (vocab_size, tuple(stop_ids))
    if key not in kept:
        kept[key] = Vocabulary(tokenizer, vocab_size, stop_ids)
    return kept[key]


@functools.lru_cache(maxsize=256)
def _compiled(grammar: Grammar) -> str:
    """llguidance's form of a grammar (its text checked when a matcher is made)."""
    matcher = _llguidance().LLMatcher
    if grammar.kind == "json_schema":
        try:
            return matcher.grammar_from_json_schema(grammar.source, defaults=JSON_STYLE)
        except ValueError as e:
            raise GenerateError(f"json schema: {e}") from None
    if grammar.kind == "regex":
        return matcher.grammar_from_regex(grammar.source)
    return matcher.grammar_from_lark(grammar.source)


@functools.lru_cache(maxsize=256)
def _checked(grammar: Grammar, vocab: Vocabulary) -> str:
    return _validated(grammar, vocab.lltokenizer)


def _validated(grammar: Grammar, lltokenizer) -> str:
    """The compiled grammar, or a GenerateError saying why llguidance refuses it (over
    `lltokenizer`'s tokens, or none)."""
    compiled = _compiled(grammar)
    error = _llguidance().LLMatcher.validate_grammar(compiled, lltokenizer)
    if error and not error.startswith("WARNING"):
        raise GenerateError(f"{grammar.describe()}: {' '.join(error.split())}")
    return compiled


class Matcher:
    """One row's place in its grammar: the mask of what may come next, and the tokens taken."""

    def __init__(self, grammar: Grammar, vocab: Vocabulary):
        self.grammar, self.vocab = grammar, vocab
        self._matcher = _llguidance().LLMatcher(vocab.lltokenizer, _checked(grammar, vocab),
                                                log_level=0)
        self._check()

    def copy(self) -> Matcher:
        """Another matcher at this one's place: llguidance's state copied in microseconds,
        where a new matcher parses the grammar again (~0.3 ms for a JSON schema; a server
        makes one per request)."""
        other = copy.copy(self)
        other._matcher = self._matcher.deep_copy()
        return other

    def fill(self, words_W: np.ndarray) -> None:
        """Writes the allowed next tokens into `words_W` (int32 `[W]`, contiguous)."""
        self._matcher.unsafe_compute_mask_ptr(words_W.ctypes.data, words_W.nbytes)

    def accept(self, token: int) -> None:
        """Follows the token the row took (one the mask allowed)."""
        if not self._matcher.consume_token(int(token)):
            self._check()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of these tokens, in order, the grammar would take from here."""
        return self._matcher.validate_tokens([int(t) for t in tokens])

    def allows(self, words_W: np.ndarray, token: int) -> bool:
        """Whether the mask `words_W` (one `fill` wrote) allows `token`."""
        return bool((int(words_W[token // 32]) >> (token % 32)) & 1)

    def rollback(self, n: int) -> None:
        """Back before the last `n` tokens taken."""
        if n:
            self._matcher.rollback(n)

    def reset(self) -> None:
        """Back to the grammar's start (a preempted request decodes anew)."""
        self._matcher.reset()

    @property
    def ended(self) -> bool:
        """The grammar takes nothing more (only the ending ids may follow)."""
        return self._matcher.is_stopped()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GenerateError(f"{self.grammar.describe()}: {self._matcher.get_error()}")


class Constrained:
    """The grammars of a batch's rows (`matchers`, None where a row has none): the masks of
    their next step, and the tokens they took."""

    def __init__(self, matchers: list[Matcher | None], words: int, stop_ids: Sequence[int]):
        self.matchers, self.words, self.stop_ids = matchers, words, frozenset(stop_ids)

    @classmethod
    def of(cls, grammars: Sequence[Grammar | None], tokenizer: Tokenizer | None,
           vocab_size: int, stop_ids: Sequence[int], batch: int) -> Constrained | None:
        """Rows of these grammars, then rows without one up to `batch`; None when no row has
        a grammar."""
        if all(g is None for g in grammars):
            return None
        if tokenizer is None:
            raise GenerateError("constrained decoding needs the tokenizer (tokenizer=...): a "
                                "grammar is over text, and the tokens' text comes from it")
        vocab = vocabulary(tokenizer, vocab_size, stop_ids)
        matchers = [None if g is None else Matcher(g, vocab) for g in grammars]
        return cls(matchers + [None] * (batch - len(matchers)), vocab.words, stop_ids)

    def mask(self) -> np.ndarray:
        """int32 `[B, W]`: what each row may take next."""
        return masks(self.matchers, self.words)

    def guessed_masks(self, guess_BK: np.ndarray, n_guess_B: np.ndarray) -> np.ndarray:
        """int32 `[B, K + 1, W]`: what each row may take at each position of a speculative
        round over its guesses: position j's mask after the row's first j guesses (every bit
        set past a guess the grammar forbids, or a stop: the row keeps no guess there). The
        grammars are left where they were."""
        B, K = guess_BK.shape
        out_BTW = np.full((B, K + 1, self.words), ALL_ALLOWED, np.int32)
        for b, matcher in enumerate(self.matchers):
            if matcher is None:
                continue
            matcher.fill(out_BTW[b, 0])
            taken = 0
            for j, token in enumerate(guess_BK[b, :n_guess_B[b]].tolist()):
                if token in self.stop_ids or not matcher.allows(out_BTW[b, j], token):
                    break
                matcher.accept(token)
                taken += 1
                matcher.fill(out_BTW[b, j + 1])
            matcher.rollback(taken)
        return out_BTW

    def follow(self, new_tokens: Sequence[Sequence[int]]) -> None:
        """Each row's grammar after the tokens the row took (its first rows')."""
        for matcher, tokens in zip(self.matchers, new_tokens):
            for token in tokens if matcher is not None else ():
                matcher.accept(token)


def masks(matchers: Sequence[Matcher | None], words: int) -> np.ndarray:
    """The packed masks of a batch of rows, int32 `[B, W]` (a row without a grammar allows
    every token)."""
    out_BW = np.full((len(matchers), words), ALL_ALLOWED, np.int32)
    for b, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.fill(out_BW[b])
    return out_BW


def allowed(mask_BW: jax.Array, vocab_size: int) -> jax.Array:
    """The packed masks unpacked: bool `[B, V]` (any leading axes: `[B, T, W]` gives
    `[B, T, V]`), True where token v's bit is set."""
    v_V = jnp.arange(vocab_size, dtype=jnp.int32)
    words_BV = jnp.take(mask_BW, v_V // 32, axis=-1)
    return (jnp.right_shift(words_BV, v_V % 32) & 1).astype(bool)


def masked(logits_BV: jax.Array, mask_BW: jax.Array | None) -> jax.Array:
    """The logits with -inf where the masks forbid the token (as they are without masks);
    any leading axes, as `allowed`."""
    if mask_BW is None:
        return logits_BV
    return jnp.where(allowed(mask_BW, logits_BV.shape[-1]), logits_BV, -jnp.inf)


def call_grammar(form: ToolFormat, tools: Sequence[dict], name: str | None = None,
                 parallel: bool = True, content_schema: dict | None = None) -> Grammar:
    """An answer that is calls of `tools`, each call's arguments valid under its function's
    parameter schema: one call of the function `name` when given (as vLLM makes a named
    tool_choice), else one or, when `parallel`, more; or, with `content_schema`, a JSON value
    of that schema instead."""
    parallel = parallel and name is None
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    call = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f["name"]}, form.arguments: f.get("parameters") or EMPTY_PARAMETERS},
        "required": ["name", form.arguments], "additionalProperties": False} for f in chosen]}
    if form.listed:
        items = {"type": "array", "items": call, "minItems": 1, **({} if parallel else
                                                                  {"maxItems": 1})}
        rules = [f"calls: {_literal(form.open)} {_json(items)} {_literal(form.close)}"]
    else:
        block = (f"{_literal(form.open + chr(10))} {_json(call)} {_literal(chr(10) + form.close)}"
                 if form.open else _json(call))
        separator = _literal("\n" if form.open else "; ")
        rules = [f"call: {block}", f"calls: call ({separator} call)*" if parallel else
                 "calls: call"]
    start = "start: calls" if content_schema is None else f"start: calls | {_json(content_schema)}"
    return Grammar.lark("\n".join([start, *rules]))


def _json(schema: dict) -> str:
    """A Lark rule's JSON value of `schema`, written as `json.dumps` writes JSON."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def row_grammars(n_rows: int, grammar: Any = None, json_schema: Any = None,
                 regex: Any = None) -> list[Grammar | None]:
    """One grammar (or None) per row from what a caller gives, at most one kind of: `grammar`
    (a Grammar or a Lark grammar's text), `json_schema` (a dict or its JSON text) or `regex`;
    each one for every row or a list of one (or None) per row."""
    given = {name: value for name, value in (("grammar", grammar), ("json_schema", json_schema),
                                             ("regex", regex)) if value is not None}
    if not given:
        return [None] * n_rows
    if len(given) > 1:
        raise GenerateError(f"give one of grammar, json_schema and regex, not {', '.join(given)}")
    (name, value), = given.items()
    make = {"grammar": lambda g: g if isinstance(g, Grammar) else Grammar.lark(g),
            "json_schema": Grammar.json_schema, "regex": Grammar.regex}[name]
    per_row = isinstance(value, (list, tuple))
    if per_row and len(value) != n_rows:
        raise GenerateError(f"{len(value)} values of {name} for {n_rows} prompts: give one for "
                            "all or one (or None) per prompt")
    values = value if per_row else [value] * n_rows
    return [None if v is None else make(v) for v in values]
