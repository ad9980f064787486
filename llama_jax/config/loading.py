"""Config files: YAML with a `base:` chain (a preset name or a path relative to the file) whose
content a file overrides key by key, so an ablation is a few lines of difference; presets are
the files of `configs/`; `SECTION.KEY=VALUE` overrides from the command line. Every error names
the file and the field.

A run's config is read by `llama_jax.load_run_config` (`train.finetune`), which also takes a
fine-tuning run's model from its `init_from` checkpoint; this module reads the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml

from llama_jax.config.model import ModelConfig
from llama_jax.config.run import RunConfig
from llama_jax.errors import ConfigError

# The presets ship inside the package (`llama_jax/presets`, a link to the repository's configs/
# that a wheel carries as package data), so an installed package finds them as a checkout does.
CONFIG_DIR = (Path(__file__).resolve().parent.parent / "presets").resolve()
SECTIONS = ("model", "train", "data", "mesh", "task", "lora")
SCALARS = ("init_from",)  # top-level keys that are values, not sections


def resolve_config_path(name_or_path: str | Path, relative_to: Path | None = None) -> Path:
    """A preset name (`llama3-8b`) or a path; relative paths are tried next to `relative_to`."""
    path = Path(name_or_path)
    candidates = [path]
    if relative_to is not None and not path.is_absolute():
        candidates.insert(0, relative_to / path)
    if path.suffix not in (".yaml", ".yml") and len(path.parts) == 1:
        candidates.append(CONFIG_DIR / f"{path}.yaml")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    presets = ", ".join(list_presets())
    raise ConfigError(f"config {str(name_or_path)!r} is neither a file nor a preset; "
                      f"presets: {presets}")


def read_yaml_mapping(path: Path, what: str, keys: Sequence[str] = ()) -> dict[str, Any]:
    """The mapping at the top level of a YAML file (an empty file: {}); the errors name the file,
    `what` it is when it cannot be read, and the `keys` a mapping of its kind has if given."""
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read {what}: {e}") from None
    if not isinstance(tree, dict):
        shape = f"a mapping with keys {', '.join(keys)}" if keys else "a mapping at the top level"
        raise ConfigError(f"{path}: expected {shape}, got {type(tree).__name__}")
    return tree


def load_config_tree(name_or_path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Reads a YAML config with its `base:` chain merged in (the child wins, key by key)."""
    path = resolve_config_path(name_or_path, _seen[-1].parent if _seen else None).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"{path}: `base` chain loops: {chain}")
    tree = read_yaml_mapping(path, "config")
    unknown = [k for k in tree if k not in (*SECTIONS, *SCALARS, "base")]
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s) {unknown}; expected base, "
                          f"{', '.join(SCALARS)} and sections {list(SECTIONS)}")
    base = tree.pop("base", None)
    if base is None:
        return tree
    return _merge(load_config_tree(base, (*_seen, path)), tree)


def _merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_run_tree(name_or_path: str | Path, overrides: Sequence[str] = ()
                  ) -> tuple[dict[str, Any], Path]:
    """The merged tree of a config file or preset with `SECTION.KEY=VALUE` overrides (values
    parsed as YAML; `init_from=PATH` for the top-level key), and the file's path."""
    path = resolve_config_path(name_or_path)
    tree = load_config_tree(path)
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key in SCALARS:
            tree[key] = yaml.safe_load(value)
            continue
        *parents, leaf = key.split(".")
        if not sep or not parents or parents[0] not in SECTIONS:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE with SECTION one of "
                              f"{', '.join(SECTIONS)} (e.g. train.learning_rate=1e-3)")
        node = tree
        for name in parents:
            if node.get(name) is None:  # absent, or an empty `name:` in the YAML
                node[name] = {}
            node = node[name]
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {name} is {node!r} in {path}, not a mapping")
        node[leaf] = yaml.safe_load(value)
    return tree, path


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """The validated `model:` section of a config file or preset."""
    return load_sections(name_or_path).model


def load_sections(name_or_path: str | Path) -> RunConfig:
    """The validated sections of a config file or preset as written (an `init_from`
    checkpoint is not opened: the model is the file's)."""
    tree, path = load_run_tree(name_or_path)
    return RunConfig.from_tree(tree, str(path))


def list_presets() -> list[str]:
    """Names of the complete model presets (files starting with `_` are family bases)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if not p.stem.startswith("_"))
