"""`GET /metrics`: the server's counters in Prometheus's text format (prometheus-client), on a
registry of its own (not the process-wide default, so servers built in one process do not
share it).

- `llama_jax_choices_total{finish_reason}`: choices finished (stop, length, error), counted
  when their response is complete; `llama_jax_prompt_tokens_total` and
  `llama_jax_generation_tokens_total`: the sums of those responses' `usage` (a prompt counts
  once per request, as `usage.prompt_tokens` does).
- `llama_jax_time_to_first_token_seconds`: from a choice's submission (after its request was
  read and tokenized) to its first tokens leaving the engine; `llama_jax_inter_token_latency_
  seconds`: the time between a choice's deliveries divided by the tokens delivered, once per
  token (a dispatch of K decode steps delivers K tokens at once).
- `llama_jax_cached_prompt_tokens_total`: the sum of those responses'
  `usage.prompt_tokens_details.cached_tokens`.
- `llama_jax_queue_length`, `llama_jax_slots_in_use`, `llama_jax_slots`,
  `llama_jax_requests_running` (holding a row), `llama_jax_requests_waiting` (queued or
  being prefilled), `llama_jax_kv_pages_total` and `llama_jax_kv_pages_used` (the KV cache's
  pages, and those rows, prompts or the prefix cache hold), `llama_jax_prefix_cache_blocks`
  and `llama_jax_prefix_cache_blocks_used`: read from the engine when scraped; so are its
  counters `llama_jax_prefill_chunks_total` (prefill programs run),
  `llama_jax_prefix_cache_lookups_total` (prompts looked up), `llama_jax_prefix_cache_
  hits_total` (those that restored at least one block), `llama_jax_prefix_cache_hit_tokens_
  total` (the tokens they restored, counted when the prompt is admitted),
  `llama_jax_preemptions_total` (rows preempted when the pages ran short),
  `llama_jax_constrained_requests_total` (requests decoded under a grammar) and
  `llama_jax_grammar_mask_seconds_total` (the host time their token masks took).
"""

from __future__ import annotations

from typing import Sequence

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from llama_jax.serve.engine import COUNTERS

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The counters of one server over `engine` (anything with `stats()` as Engine's)."""

    def __init__(self, engine):
        registry = self.registry = CollectorRegistry()
        self.choices = Counter("llama_jax_choices", "Choices finished, by finish reason",
                               ["finish_reason"], registry=registry)
        self.prompt_tokens = Counter("llama_jax_prompt_tokens",
                                     "Prompt tokens of complete responses (usage)",
                                     registry=registry)
        self.generation_tokens = Counter("llama_jax_generation_tokens",
                                         "Generated tokens of complete responses (usage)",
                                         registry=registry)
        self.time_to_first_token = Histogram(
            "llama_jax_time_to_first_token_seconds", "Submission to a choice's first tokens",
            buckets=TTFT_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram(
            "llama_jax_inter_token_latency_seconds", "Time per token between deliveries",
            buckets=ITL_BUCKETS, registry=registry)
        self.cached_tokens = Counter("llama_jax_cached_prompt_tokens",
                                     "Prompt tokens of complete responses restored from the "
                                     "prefix cache (usage)", registry=registry)
        for name, doc in (("queued", "Requests waiting for a slot"),
                          ("slots_in_use", "Decode slots holding a request"),
                          ("slots", "Decode slots"),
                          ("requests_running", "Requests holding a decode row"),
                          ("requests_waiting", "Requests queued or being prefilled"),
                          ("kv_pages_total", "Pages of the KV cache"),
                          ("kv_pages_used", "Pages of the KV cache held by rows, prompts or "
                                            "the prefix cache"),
                          ("prefix_cache_blocks", "Blocks of the prefix cache"),
                          ("prefix_cache_blocks_used", "Blocks of the prefix cache holding a "
                                                       "chunk")):
            Gauge("llama_jax_queue_length" if name == "queued" else f"llama_jax_{name}", doc,
                  registry=registry).set_function(lambda name=name: engine.stats()[name])
        registry.register(_EngineCounters(engine))

    def delivered(self, first: bool, tokens: int, seconds: float) -> None:
        """A choice's delivery of `tokens` tokens `seconds` after its submission (`first`) or
        its previous delivery."""
        if first:
            self.time_to_first_token.observe(seconds)
            return
        for _ in range(tokens):
            self.inter_token_latency.observe(seconds / tokens)

    def completed(self, usage: dict, finish_reasons: Sequence[str | None]) -> None:
        """A complete response: its `usage` and its choices' finish reasons."""
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.cached_tokens.inc(usage["prompt_tokens_details"]["cached_tokens"])
        self.generation_tokens.inc(usage["completion_tokens"])
        for reason in finish_reasons:
            self.choices.labels(reason or "error").inc()

    def text(self) -> tuple[bytes, str]:
        """The exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCounters(Collector):
    """The engine's own counters (`Engine.stats()`), read when scraped."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(f"llama_jax_{name}", doc, value=stats[name])
