"""Which decoder runs, and whether it fits: "scan" (a `lax.scan` per layer group over stacked
weights, the stacked cache in the carry) or "unrolled" (a loop over per-layer weights and
caches, `model.unstack_layers`); both compute the same function. `resolve_decode_impl` picks
one for "auto" by the parameters' platform and the device memory free; `decoder_params` makes
(once per set of parameter arrays, dropped with them) the per-layer copy the unrolled decoder
reads; `cache_bytes_per_device` and `memory_need` are what a decode's KV cache takes of a
device's memory. `generate.py` and the server's slots decode with what this chooses.
"""

from __future__ import annotations

import logging
import weakref

import jax

from llama_jax.config import MeshConfig, ModelConfig
from llama_jax.errors import GenerateError
from llama_jax.model.params import Params
from llama_jax.model.transformer import unstack_layers
from llama_jax.parallel import sharding, target
from llama_jax.parallel.devices import free_memory_bytes
from llama_jax.parallel.sharding import MESH_AXES
from llama_jax.plan.costs import SERVING_PAGE_SIZE
from llama_jax.plan.memory import kv_cache_bytes_per_device
from llama_jax.plan.serving import ServerShape

log = logging.getLogger(__name__)

# How the decoder runs the layers: one lax.scan per group over stacked weights with the
# stacked cache in the carry, or an unrolled loop over per-layer weights and caches. Both
# compute the same function; "auto" picks by backend (`resolve_decode_impl`).
DECODE_IMPLS = ("auto", "scan", "unrolled")
# Backends where the unrolled decoder is the faster (BENCHMARKS.md). XLA:CPU copies every
# layer's weights out of the stacked arrays at every scan step. On an H100 the unrolled
# decoder was 1.2x the scan at batch 1 and 1.9x at batch 8 (one lease; another measured it
# slower, its launches bound by the host). On XLA:TPU's clock (no TPU has run it) LLaMA-3 8B's
# batch-1 step on a v5e is 1.45x faster unrolled (23.7 ms against 34.3, bf16): the scan copies
# each layer's MLP weights out of the stacked arrays first.
UNROLLED_BACKENDS = ("cpu", "gpu", "tpu")

# ids of the arrays -> (weakrefs to them, unstacked copy), oldest first: a model's, and a
# speculative decoder's draft's
_UNSTACKED: dict = {}
_MAX_COPIES = 2


def is_unstacked(params: Params) -> bool:
    """Whether `params` are the unrolled decoder's (`unstack_layers`), not stacked."""
    return isinstance(params["groups"][0], tuple)


def resolve_decode_impl(decode_impl: str, params: Params, reserve_bytes: int = 0) -> str:
    """"scan" or "unrolled" for `decode_impl`. "auto" is unrolled for parameters already
    unstacked, and for stacked ones on UNROLLED_BACKENDS (or whose per-layer copy exists) when
    that copy, held while the stacked arrays live, fits in the device memory free beyond
    `reserve_bytes` (what the caller allocates next on each device: its KV cache); scan
    otherwise, dropping a copy that no longer leaves room."""
    if decode_impl not in DECODE_IMPLS:
        raise GenerateError(f"decode_impl={decode_impl!r} is not one of {', '.join(DECODE_IMPLS)}")
    if decode_impl != "auto":
        return decode_impl
    if is_unstacked(params):
        return "unrolled"
    copy = _cached_copy(params)
    if copy is None and target.platform_of_tree(params) not in UNROLLED_BACKENDS:
        return "scan"
    need = memory_need(
        reserve_bytes + (0 if copy is not None else sharding.bytes_per_device(params["groups"])),
        params)
    free = free_memory_bytes()
    if free is None or need <= free:
        return "unrolled"
    release_decoder_copy()  # a copy that exists goes: the scan has its room
    log.info("decode_impl='auto': the per-layer copy of the weights and the cache need %.2f GiB "
             "of the %.2f GiB free; decoding with 'scan'", need / 2**30, free / 2**30)
    return "scan"


def cache_bytes_per_device(config: ModelConfig, params: Params, batch: int, slots: int,
                           cache_dtype: str, mesh_config: MeshConfig | None) -> int:
    """Bytes one device holds of the KV cache of `batch` rows of `slots` laid out, for
    parameters on a mesh, by `mesh_config`'s rules (the default rules when None)."""
    mesh = sharding.mesh_of(params)
    shape = dict.fromkeys(MESH_AXES, 1) | ({} if mesh is None else dict(mesh.shape))
    rules = (mesh_config or MeshConfig()).cache_rules
    return kv_cache_bytes_per_device(config, batch, slots, cache_dtype, rules, shape)


def rows_cache_bytes(config: ModelConfig, params: Params, batch: int, max_len: int,
                     cache_dtype: str, mesh_config: MeshConfig | None,
                     draft: tuple[ModelConfig, Params] | None = None) -> int:
    """`cache_bytes_per_device` of a server's rows over `max_len` positions, and of a draft
    model's cache of as many beside them (`draft`: its config and parameters, on one
    device)."""
    cache = cache_bytes_per_device(config, params, batch, max_len, cache_dtype, mesh_config)
    if draft is not None:
        cache += cache_bytes_per_device(*draft, batch, max_len, cache_dtype, None)
    return cache


def page_bytes(config: ModelConfig, params: Params, page_size: int, cache_dtype: str,
               mesh_config: MeshConfig | None,
               draft: tuple[ModelConfig, Params] | None = None) -> int:
    """The bytes one device holds per page of a server's pool of pages of `page_size`
    positions (and of a draft model's pool beside it): pages are split over the devices as
    rows are, so a pool of a multiple of the devices holds that many times this."""
    devices = pool_devices(params)
    pool = rows_cache_bytes(config, params, devices, page_size, cache_dtype, mesh_config, draft)
    return -(-pool // devices)


def pool_devices(params: Params) -> int:
    """The devices a server's pool of pages is split over: those of the parameters' mesh
    (abstract parameters' too), or one."""
    mesh = sharding.mesh_of(params)
    return 1 if mesh is None else mesh.size


def server_shape(config: ModelConfig, params: Params, cache_dtype: str,
                 mesh_config: MeshConfig | None, draft: tuple[ModelConfig, Params] | None,
                 **flags) -> ServerShape:
    """`ServerShape.of` a server of `config` with `params` (their mesh splits its pool of
    pages) and a cache of `cache_dtype`, beside a draft model's (`draft`: its config and
    parameters)."""
    each = page_bytes(config, params, flags.get("page_size", SERVING_PAGE_SIZE), cache_dtype,
                      mesh_config, draft)
    return ServerShape.of(config.max_seq_len, each, devices=pool_devices(params), **flags)


def memory_need(bytes_per_device: int, params: Params) -> int:
    """What `bytes_per_device` on each device holding `params` takes from the memory
    `free_memory_bytes()` reports: one device's own on an accelerator, every device's on CPU,
    whose devices all draw on the host."""
    on_cpu = target.platform_of_tree(params) == "cpu"
    return bytes_per_device * (_device_count(params) if on_cpu else 1)


def _device_count(params: Params) -> int:
    """How many devices hold `params` (1 for host arrays)."""
    leaf = jax.tree.leaves(params)[0]
    return len(leaf.sharding.device_set) if isinstance(leaf, jax.Array) else 1


def _cached_copy(params: Params) -> Params | None:
    """The per-layer copy made of these very arrays, if it is still held."""
    leaves = jax.tree.leaves(params)
    refs, unstacked = _UNSTACKED.get(tuple(id(leaf) for leaf in leaves), ((), None))
    if len(refs) == len(leaves) and all(r() is leaf for r, leaf in zip(refs, leaves)):
        return unstacked
    return None


def decoder_params(params: Params, decode_impl: str) -> Params:
    """The unrolled decoder runs over unstacked layers (see `model.unstack_layers`); the copy
    is made once per set of parameter arrays and reused while those arrays are alive. A caller
    that drops the stacked arrays after this call holds one copy of the weights."""
    if is_unstacked(params):
        if decode_impl == "scan":
            raise GenerateError("decode_impl='scan' needs stacked parameters; these were "
                                "unstacked (model.unstack_layers): pass the stacked ones")
        return params
    if decode_impl == "scan":
        return params
    unstacked = _cached_copy(params)
    if unstacked is None:
        leaves = jax.tree.leaves(params)
        key = tuple(id(leaf) for leaf in leaves)
        unstacked = unstack_layers(params)
        while len(_UNSTACKED) >= _MAX_COPIES:
            _UNSTACKED.pop(next(iter(_UNSTACKED)))
        # The copy goes when an original array does: no second model lingers after generation.
        drop = lambda _: _UNSTACKED.pop(key, None)  # noqa: E731
        _UNSTACKED[key] = (tuple(weakref.ref(leaf, drop) for leaf in leaves), unstacked)
    return unstacked


def release_decoder_copy() -> None:
    """Drops the per-layer copy kept for stacked parameters still alive (the next unrolled
    decode of them makes it again): for a program that goes on to other work with them."""
    _UNSTACKED.clear()


def owned_decoder_params(params: Params, decode_impl: str) -> tuple[Params, str]:
    """`decoder_params` for a caller that drops `params` next (a CLI or a server that loaded
    them), and the implementation chosen, for the caller to decode with: "auto" reserves
    nothing for the cache, since the stacked arrays are gone by then."""
    impl = resolve_decode_impl(decode_impl, params)
    return decoder_params(params, impl), impl
