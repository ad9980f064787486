"""A server from a checkpoint: the tokenizer, the model (dtype, int8, attention, mesh), the
check that its KV cache fits, the chat format and the engine."""

from __future__ import annotations

from pathlib import Path

from llama_jax.config import MeshConfig, cache_dtype_name
from llama_jax.data.tokenizer import load_tokenizer
from llama_jax.decode.decoder import memory_need, owned_decoder_params, server_shape
from llama_jax.errors import ConfigError, GenerateError
from llama_jax.formats.checkpoint import load_checkpoint
from llama_jax.parallel import target
from llama_jax.parallel.devices import free_memory_bytes
from llama_jax.parallel.sharding import make_mesh
from llama_jax.plan.costs import (SERVING_PAGE_SIZE, SERVING_PREFILL_CHUNK,
                                  SERVING_STEPS_PER_DISPATCH)
from llama_jax.serve.api import Server
from llama_jax.data.chat import chat_format
from llama_jax.serve.engine import Engine
from llama_jax.plan.serving import ServerShape

GIB = 1 << 30


def build(checkpoint: str | Path, *, tokenizer: str | Path | None = None, dtype=None,
          quantize: str | None = None, quantize_head: bool = False, cache_dtype=None,
          max_batch: int = 8, max_seq_len: int | None = None, attention_impl: str = "auto",
          decode_impl: str = "auto", mesh: MeshConfig | None = None,
          steps_per_dispatch: int = SERVING_STEPS_PER_DISPATCH,
          prefill_chunk: int = SERVING_PREFILL_CHUNK, prefix_cache_bytes: int | None = None,
          page_size: int = SERVING_PAGE_SIZE, kv_cache_bytes: int | None = None,
          max_queue: int = 64, model_name: str | None = None, speculate: str | None = None,
          num_speculative_tokens: int = 4, ngram: tuple[int, int] = (1, 3),
          min_accepted: float | None = None,
          draft_checkpoint: str | Path | None = None) -> tuple[Server, Engine]:
    """The API state and its (not yet started) engine for `checkpoint`. The rows' KV cache
    takes `kv_cache_bytes` per device of pages of `page_size` positions (None: a longest row
    for each row, or what fits `KV_CACHE_SHARE` of the memory left when less); the prefix
    cache `prefix_cache_bytes` (None: `ServerShape.with_default_prefix_cache`;
    0: none);
    `speculate` and the rest are the engine's; `draft_checkpoint` is a draft model's, loaded
    as the model is (`dtype`, `quantize`; speculate="draft" is implied by it)."""
    tok = load_tokenizer(tokenizer or checkpoint)
    device_mesh = None if mesh is None else make_mesh(mesh)
    config, params = load_checkpoint(checkpoint, dtype, quantize=quantize,
                                     quantize_head=quantize_head, mesh=device_mesh,
                                     mesh_config=mesh)
    draft = None
    if draft_checkpoint is not None:  # loaded before the cache check counts what is free
        draft = load_checkpoint(draft_checkpoint, dtype, quantize=quantize,
                                quantize_head=quantize_head)
    try:
        config = config.with_execution(attention_impl=attention_impl)
        cache_dtype = cache_dtype_name(cache_dtype, config.compute_dtype)
    except ConfigError as e:
        raise GenerateError(str(e)) from None
    speculating = speculate is not None or draft is not None
    shape = check_cache_fits(config, params, cache_dtype, mesh, draft, prefix_cache_bytes,
                             max_batch=max_batch, max_seq_len=max_seq_len,
                             steps=steps_per_dispatch, prefill_chunk=prefill_chunk,
                             page_size=page_size, kv_cache_bytes=kv_cache_bytes,
                             speculative_tokens=num_speculative_tokens if speculating else 0)
    # The server keeps one copy of the weights, the decoder's: the stacked arrays go here.
    params, decode_impl = owned_decoder_params(params, decode_impl)
    if draft is not None:
        draft = (draft[0].with_execution(attention_impl=attention_impl),
                 owned_decoder_params(draft[1], decode_impl)[0])
    stop_ids = sorted({*config.stop_ids, *(t for t in tok.eos_ids if t < config.vocab_size)})
    # The engine's shape is the one checked: the rows' pages and the prefix cache as bytes.
    engine = Engine(config, params, max_batch=max_batch, max_seq_len=shape.max_seq_len,
                    stop_ids=stop_ids, cache_dtype=cache_dtype, decode_impl=decode_impl,
                    steps_per_dispatch=steps_per_dispatch, prefill_chunk=prefill_chunk,
                    prefix_cache_bytes=shape.prefix_bytes, page_size=page_size,
                    kv_cache_bytes=shape.rows_bytes, max_queue=max_queue,
                    mesh_config=mesh, speculate=speculate,
                    num_speculative_tokens=num_speculative_tokens, ngram=ngram,
                    min_accepted=min_accepted, draft=draft)
    name = model_name or Path(checkpoint).name
    return Server(engine, tok, name, chat_format(checkpoint, tok)), engine


def check_cache_fits(config, params, cache_dtype: str, mesh: MeshConfig | None, draft=None,
                     prefix_cache_bytes: int | None = None, **flags) -> ServerShape:
    """The shape (`server_shape` of the `flags`) of a server whose rows' KV cache pages take
    `--kv-cache-bytes`, by default at most a share of the memory left after loading the
    model (and the draft model `(config, params)`, if any): on a mesh, the part of the pool
    one device holds against that device's free memory. Refuses pages that do not fit it,
    then a prefix cache of `prefix_cache_bytes` more than what is left after the rows (None:
    the default share of it)."""
    free = free_memory_bytes()
    # CPU: the host's memory, whole, for every device's part
    on_each = mesh is not None and target.platform_of_tree(params) != "cpu"
    sharing = memory_need(1, params)
    room = None if free is None else free // sharing  # a device's
    shape = server_shape(config, params, cache_dtype, mesh, draft, cache_room=room, **flags)
    need = memory_need(shape.pool_bytes, params)
    where = " on a device" if on_each else ""
    if free is not None and need > free:
        part = "each device's part of the KV cache" if on_each else "the KV cache"
        kv_cache_bytes = flags.get("kv_cache_bytes")
        what = (f"of --kv-cache-bytes {kv_cache_bytes}" if kv_cache_bytes is not None else
                f"of --max-batch {shape.max_batch} rows of --max-seq-len {shape.max_seq_len} "
                "tokens")
        raise GenerateError(
            f"{part} {what} ({cache_dtype}) needs {need / GIB:.2f} GiB, but "
            f"{free / GIB:.2f} GiB is free{where} after loading the model: lower "
            "--kv-cache-bytes, --max-batch or --max-seq-len, or use --cache-dtype int8")
    if prefix_cache_bytes is None:
        return shape.with_default_prefix_cache(room)
    left = None if room is None else room - shape.pool_bytes
    if prefix_cache_bytes < 0 or (left is not None and prefix_cache_bytes > left):
        raise GenerateError(
            f"--prefix-cache-bytes {prefix_cache_bytes} must be >= 0 and at most the "
            f"{max(left or 0, 0) / GIB:.2f} GiB free{where} after the weights and the rows' "
            "KV cache")
    return shape.with_prefix_cache(prefix_cache_bytes)
