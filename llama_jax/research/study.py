"""Study files: a study names a base run config, variants of it (a few `--set`-style overrides
each) and seeds; every variant x seed is an ordinary training run, named by its run key.

A study file (`configs/ablations/NAME.yaml`):

    base: ../demo.yaml             # a run config or preset (relative to the study file)
    seeds: [0, 1]                  # or a count: 2 -> [0, 1]
    match: params                  # optional: params | active_params | flops
    match_field: model.ffn_dim     # the width field adjusted to match the first variant
    variants:                      # the first is the baseline the others are compared with
      rmsnorm: {}
      layernorm: {model.norm: layernorm}
      moe: {model.mlp: moe, ..., match: false}   # not matched: sized as written
    eval_seq_lens: [128, 256]      # optional: validation losses at these lengths too

What must stay equal across variants — the data (corpus, tokenizer, split) and the token budget
(steps x batch x sequence length) — is checked: a variant that would change it is refused
before anything trains, naming the variant, as is an unknown field or value, or a variant the
model's own validation refuses. With `match`, each variant's `match_field` (an integer field of the
model section, such as ffn_dim) is bisected for the value whose parameter count (total or
active) or training FLOPs per token is closest to the baseline's, and the study says what it
chose.

A run's key (`run_key`) hashes its resolved config, so a study run again finds the runs it
trained: the keys of the shipped studies' finished runs must not change.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from llama_jax.config import RunConfig, resolve_config_path
from llama_jax.config.loading import read_yaml_mapping
from llama_jax.errors import ConfigError
from llama_jax.plan import costs
from llama_jax.training.finetune import load_run_config

MATCHES = ("params", "active_params", "flops")
# Fields a variant may not override: they define the data and the token budget every variant
# shares.
FIXED_SECTIONS = ("data",)
FIXED_TRAIN = ("seq_len", "batch_size", "steps")
STUDY_KEYS = ("base", "seeds", "match", "match_field", "variants", "eval_seq_lens")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]  # SECTION.KEY=VALUE, the study's and the matching's
    run: RunConfig  # resolved, seed 0 of the study's seeds applied by `for_seed`
    matched: str | None = None  # what matching changed, for the report
    match: bool = True  # False: kept as written under the study's `match` (`match: false`)

    def for_seed(self, seed: int) -> RunConfig:
        return dataclasses.replace(self.run, train=dataclasses.replace(self.run.train,
                                                                      seed=seed))


@dataclasses.dataclass(frozen=True)
class Study:
    path: Path
    base: Path
    seeds: tuple[int, ...]
    variants: tuple[Variant, ...]
    match: str | None = None
    eval_seq_lens: tuple[int, ...] = ()  # extra evaluations at these lengths (e.g. 2 x T)

    def run_name(self, variant: Variant, seed: int) -> str:
        """`{variant}-{run_key}`: an edited variant gets a new run directory and an unchanged
        one is found again."""
        return f"{variant.name}-{run_key(variant, seed)}"


# Fields (their paths in the config) added after studies had finished runs, with their
# defaults: a field left at its default stays out of the hash, so the runs of an unchanged
# variant keep their keys. Sequence parallelism's rule became a default activation rule.
ADDED_FIELDS = {("model", "loss_chunk"): None, ("train", "mu_dtype"): None,
                ("mesh", "activation_rules", "residual_seq"): ["tensor"]}


def run_key(variant: Variant, seed: int) -> str:
    """`s{seed}-{hash}`, the hash of the resolved config (without the study's shared tokenizer
    file, which lives in the study's directory): equal keys train the same run."""
    config = variant.for_seed(seed).to_dict()
    config["data"]["tokenizer"] = None
    for (*sections, field), default in ADDED_FIELDS.items():
        node = functools.reduce(dict.__getitem__, sections, config)
        if node.get(field) == default:
            del node[field]
    resolved = json.dumps(config, sort_keys=True, default=str)
    return f"s{seed}-{hashlib.sha256(resolved.encode()).hexdigest()[:8]}"


def load_study(path: str | Path, steps: int | None = None, seeds: int | None = None,
               corpus: str | None = None) -> Study:
    """Reads and resolves a study file; every refusal names the file and the variant. `steps`,
    `seeds` and `corpus` replace the file's (and its base config's) for every variant."""
    path = Path(path)
    tree = read_yaml_mapping(path, "study", STUDY_KEYS)
    unknown = [k for k in tree if k not in STUDY_KEYS]
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; a study has {', '.join(STUDY_KEYS)}")
    if "base" not in tree or not isinstance(tree.get("variants"), dict) or not tree["variants"]:
        raise ConfigError(f"{path}: a study needs `base:` (a run config) and `variants:` (a "
                          "mapping of names to overrides, the first being the baseline)")
    base = resolve_config_path(tree["base"], path.parent)
    seed_list = _seeds(path, tree.get("seeds", 1) if seeds is None else seeds)
    match, field = tree.get("match"), tree.get("match_field")
    if match is not None and match not in MATCHES:
        raise ConfigError(f"{path}: match={match!r} is not one of {', '.join(MATCHES)}")
    if (match is None) != (field is None):
        raise ConfigError(f"{path}: `match` and `match_field` go together (the width field "
                          "adjusted so that variants match the baseline)")
    common = ([f"train.steps={steps}"] if steps is not None else []) + (
        [f"data.corpus={json.dumps(corpus)}"] if corpus is not None else [])
    variants = [_variant(path, base, name, overrides, common)
                for name, overrides in tree["variants"].items()]
    _check_shared(path, variants)
    if match is not None:
        section, _, key = field.partition(".")
        value = getattr(variants[0].run.model, key, None) if section == "model" else None
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{path}: match_field {field} must be an integer field of the "
                              f"model section (the baseline's value: {value!r})")
        target = _measure(variants[0].run, match)
        variants = [variants[0]] + [_matched(path, v, match, field, target) if v.match else v
                                    for v in variants[1:]]
    eval_seq_lens = tuple(tree.get("eval_seq_lens") or ())
    for length in eval_seq_lens:
        for v in variants:
            if not isinstance(length, int) or not 0 < length <= v.run.model.max_seq_len:
                raise ConfigError(f"{path}: eval_seq_lens {length!r} must be a positive integer "
                                  f"<= model.max_seq_len ({v.run.model.max_seq_len} in variant "
                                  f"{v.name!r})")
    return Study(path, base, seed_list, tuple(variants), match, eval_seq_lens)


def _seeds(path: Path, seeds: Any) -> tuple[int, ...]:
    if isinstance(seeds, int) and not isinstance(seeds, bool) and seeds > 0:
        return tuple(range(seeds))
    if (isinstance(seeds, list) and seeds and len(set(seeds)) == len(seeds)
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        return tuple(seeds)
    raise ConfigError(f"{path}: seeds={seeds!r} must be a positive count or a list of distinct "
                      "non-negative integers")


def _variant(path: Path, base: Path, name: str, overrides: Any,
             common: list[str]) -> Variant:
    where = f"{path}: variant {name!r}"
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"{where}: expected a mapping of SECTION.KEY: VALUE overrides, got "
                          f"{overrides!r}")
    overrides = dict(overrides)
    match = overrides.pop("match", True)
    if not isinstance(match, bool):
        raise ConfigError(f"{where}: match={match!r} must be true or false (false: keep this "
                          "variant's widths as written, e.g. an MoE sized for equal active "
                          "parameters by construction)")
    sets = []
    for key, value in overrides.items():
        section, _, field = str(key).partition(".")
        if section in FIXED_SECTIONS or (section == "train" and field in FIXED_TRAIN):
            raise ConfigError(f"{where}: {key} is shared by every variant of a study (the data "
                              "and the token budget); set it in the base config")
        sets.append(f"{key}={json.dumps(value)}")
    return Variant(name, tuple(common + sets), _resolve(where, base, common + sets),
                   match=match)


def _resolve(where: str, base: Path, overrides: list[str]) -> RunConfig:
    try:
        return load_run_config(base, overrides)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _check_shared(path: Path, variants: list[Variant]) -> None:
    """The data and token budget of every resolved variant equal the baseline's (catches
    changes that come in through other fields)."""
    first = variants[0].run
    for v in variants[1:]:
        if v.run.data != first.data:
            raise ConfigError(f"{path}: variant {v.name!r} changes the data section")
        budget = [getattr(v.run.train, f) for f in FIXED_TRAIN]
        if budget != [getattr(first.train, f) for f in FIXED_TRAIN]:
            raise ConfigError(f"{path}: variant {v.name!r} changes the token budget")


def _measure(run: RunConfig, match: str) -> float:
    if match == "flops":
        return costs.train_flops_per_token(run.model, run.train.seq_len)
    counts = costs.param_counts(run.model)
    return counts.total if match == "params" else counts.active


def _matched(path: Path, variant: Variant, match: str, field: str, target: float) -> Variant:
    """The variant with the model field `field` set to the value whose measure is closest to
    `target`. Every measure grows with a width, so a bisection finds it."""
    where = f"{path}: variant {variant.name!r}"
    key = field.partition(".")[2]
    start = getattr(variant.run.model, key)

    def run_with(value: int) -> RunConfig | None:
        try:
            model = dataclasses.replace(variant.run.model, **{key: value})
        except ConfigError:
            return None
        return dataclasses.replace(variant.run, model=model)

    low, high = 1, max(2 * start, 2)
    while (run := run_with(high)) is not None and _measure(run, match) < target:
        low, high = high, 2 * high
    while high - low > 1:  # the measure at low is below target, at high not (or invalid)
        mid = (low + high) // 2
        run = run_with(mid)
        if run is not None and _measure(run, match) < target:
            low = mid
        else:
            high = mid
    candidates = [(abs(_measure(r, match) - target), v, r)
                  for v in (low, high) if (r := run_with(v)) is not None]
    if not candidates:
        raise ConfigError(f"{where}: no value of {field} gives a valid model")
    _, value, run = min(candidates, key=lambda c: c[:2])
    note = (f"{field} {start} -> {value} ({match} {_measure(run, match):,.0f} vs the "
            f"baseline's {target:,.0f})")
    return Variant(variant.name, variant.overrides + (f"{field}={value}",), run, note)

