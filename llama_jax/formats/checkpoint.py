"""`load_checkpoint`: one entry point for every checkpoint format llama_jax reads.

    config, params = load_checkpoint("path/to/dir", dtype="bfloat16")

The directory's contents decide the format: `config.yaml` + `params/` (llama_jax, orbax),
`config.json` + safetensors (Hugging Face: Llama or GPT-2), `params.json` +
`consolidated.NN.pth` (Meta), a training run's workdir (`config.yaml` + `checkpoints/`: its
latest checkpoint; a LoRA run's adapters merged into its base), or a PEFT LoRA adapter
(`adapter_config.json`: merged into the base it names). A file is read as GGUF (llama.cpp's
format) when it starts with GGUF's magic.
"""

from __future__ import annotations

from pathlib import Path

import jax

from llama_jax.config import QUANTIZATIONS, LoraConfig, MeshConfig, ModelConfig, dtype_name
from llama_jax.errors import CheckpointError, ConfigError
from llama_jax.files import atomic_directory
from llama_jax import gguf_file
from llama_jax.formats import gguf, hf, meta, native, peft, workdir
from llama_jax.formats.loading import Loading
from llama_jax.formats.torch_layout import family_of
from llama_jax.model.params import Params, param_specs, quantize_params
from llama_jax.nn.lora import adapter_specs, merged, with_adapters
from llama_jax.parallel.sharding import param_shardings

FORMATS = {"native": native, "hf": hf, "meta": meta, "run": workdir, "gguf": gguf}


def detect_format(path: str | Path) -> str:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory or file")
    if not path.is_dir():
        if gguf_file.is_gguf(path):
            return "gguf"
        raise CheckpointError(f"{path}: not a GGUF file (it does not start with "
                              f"{gguf_file.MAGIC.decode()}), and not a checkpoint directory")
    for name, is_format in (("native", native.is_native), ("hf", hf.is_hf),
                            ("meta", meta.is_meta), ("run", workdir.is_workdir),
                            ("peft", peft.is_peft)):
        if is_format(path):
            return name
    found = ", ".join(sorted(p.name for p in path.iterdir())[:12]) or "nothing"
    if (path / hf.CONFIG).is_file():
        raise CheckpointError(f"{path}: has {hf.CONFIG} but no {hf.SINGLE} or {hf.INDEX} "
                              f"(only safetensors weights are read, never pickles); found: {found}")
    raise CheckpointError(
        f"{path}: not a checkpoint llama_jax reads; expected config.json + model.safetensors "
        f"(Hugging Face), params.json + consolidated.NN.pth (Meta) or config.yaml + params/ "
        f"(llama_jax); found: {found}")


def load_checkpoint(path: str | Path, dtype=None, *, quantize: str | None = None,
                    quantize_head: bool = False, mesh: jax.sharding.Mesh | None = None,
                    mesh_config: MeshConfig | None = None) -> tuple[ModelConfig, Params]:
    """(config, params) from any supported checkpoint; `dtype` (any dtype-like: "bfloat16",
    jnp.float32, ...) None keeps the stored dtype. The returned config computes in the same
    dtype as its parameters. `quantize="int8"` stores the blocks' matmul weights (and with
    `quantize_head` the LM head and embedding) as int8, each tensor quantized as it is read:
    the float model is never held whole. A quantized checkpoint loads quantized. With a `mesh`,
    every tensor goes straight into its sharding under `mesh_config`'s weight rules (default
    rules when None): each device receives only its shard, and the host holds one tensor at a
    time."""
    try:
        dtype = None if dtype is None else dtype_name(dtype)
        if quantize not in (None, *QUANTIZATIONS):
            raise ConfigError(f"quantize={quantize!r} is not one of "
                              f"{', '.join(QUANTIZATIONS)} (or None: as stored)")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if quantize_head and quantize is None:
        raise CheckpointError("quantize_head=True needs quantize (e.g. quantize='int8')")

    def placement(config: ModelConfig) -> Params | None:
        return None if mesh is None else param_shardings(param_specs(config), mesh,
                                                         mesh_config or MeshConfig())

    fmt, loading = detect_format(path), Loading(dtype, quantize, quantize_head)
    if fmt == "peft":
        base = peft.base_of(Path(path))
        lora, adapters = peft.load(Path(path), checkpoint_config(base))
        return _merged(base, Loading(), lora, adapters, loading, placement, path)
    if fmt == "run" and workdir.is_lora_run(Path(path)):
        run = workdir.run_config(Path(path))
        return _merged(lora_base(run.init_from), Loading(run.model.param_dtype,
                                                         run.model.quantize),
                       run.lora, workdir.load_adapters(Path(path)), loading, placement, path)
    return FORMATS[fmt].load(Path(path), loading, placement)


def lora_base(init_from: str) -> str:
    """The model a LoRA run's adapters sit on: its init_from, or the base of the PEFT adapter
    it starts from."""
    return peft.base_of(Path(init_from)) if detect_format(init_from) == "peft" else init_from


def _merged(base_path: str, base_loading: Loading, lora: LoraConfig, adapters: dict,
            loading: Loading, placement, where) -> tuple[ModelConfig, Params]:
    """The model at `base_path` (loaded as `base_loading` says) with `adapters` merged
    (W + scale·A·B), then in `loading`'s dtype and quantization. `where` (a LoRA run or a PEFT
    directory) is named by the errors."""
    try:
        config, base = FORMATS[detect_format(base_path)].load(Path(base_path), base_loading,
                                                              placement)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: the base of its adapters ({base_path}) does not "
                              f"load: {e}") from None
    wanted = adapter_specs(base, param_specs(config), lora.targets, lora.rank)
    found = {p: {k: tuple(v.shape) for k, v in ab.items()} for p, ab in adapters.items()}
    if found != {p: {k: s.shape for k, s in ab.items()} for p, ab in wanted.items()}:
        raise CheckpointError(f"{where}: its adapters {found} do not fit its base "
                              f"{base_path} (another model now?)")
    params = merged(with_adapters(base, adapters, lora.scale))
    float_config = loading.in_dtype(config.with_execution(quantize=None, quantize_head=False),
                                    config.param_dtype)
    params = jax.tree.map(lambda w: w.astype(float_config.param_dtype), params)
    config = loading.config(float_config, float_config.param_dtype, where)
    if config.quantize is not None:
        params = quantize_params(float_config, params, config.quantize, config.quantize_head)[1]
    shardings = placement(config) if placement else None
    return config, params if shardings is None else jax.device_put(params, shardings)


def export_hf(config: ModelConfig, params: Params, path: str | Path) -> None:
    """Writes a Hugging Face directory (config.json + safetensors) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads: a `LlamaForCausalLM` or a
    `GPT2LMHeadModel`, by the model's architecture. Any other architecture is refused before
    anything is written; `path` must not exist or be an empty directory."""
    family_of(config)  # raises for other architectures, before a directory is created
    with atomic_directory(path) as tmp:
        hf.save(config, params, tmp)


def save_native(config: ModelConfig, params: Params, path: str | Path) -> None:
    """Writes a llama_jax checkpoint (config.yaml + orbax params/); `path` must not exist or be
    an empty directory."""
    with atomic_directory(path) as tmp:
        native.save(config, params, tmp)


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The model config of any checkpoint `load_checkpoint` reads, without its weights (Meta's
    is read with its shards memory-mapped: whether the head is tied shows in them)."""
    path = Path(path)
    fmt = detect_format(path)
    if fmt == "peft":  # its model: the base's, merged
        return checkpoint_config(peft.base_of(path))
    if fmt == "hf":
        return hf.read_config(path)
    if fmt == "meta":
        return meta.read_config(path, meta.open_shards(path))
    if fmt == "gguf":
        return gguf.read_config(path, gguf_file.open_file(path))
    config = native.read_config(path)  # native checkpoints and training runs keep a config.yaml
    if fmt == "run" and workdir.is_lora_run(path):  # its model loads merged, in float
        return config.with_execution(quantize=None, quantize_head=False)
    return config
