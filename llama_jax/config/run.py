"""The schemas of a training run: `RunConfig` and its sections (`train:`, `data:`, `mesh:`,
`task:`); the model section is `config.model.ModelConfig`. Fields declare what they accept
(`config.fields.setting`); `__post_init__` adds the checks that relate fields."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any, Mapping

from llama_jax.config.fields import build_section, check_settings, setting
from llama_jax.config.model import POOLINGS, ModelConfig
from llama_jax.errors import ConfigError, require
from llama_jax.nn.heads import HEADS
from llama_jax.parallel.sharding import MESH_AXES, RULE_TABLES

SCHEDULES = ("cosine", "wsd", "constant")
MU_DTYPES = ("bfloat16",)
FREEZES = ("none", "backbone")


def _positive(default: int, doc: str) -> Any:
    return setting(default, type="int", above=0, doc=doc)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping of a training run (the `train:` section)."""

    seq_len: int = _positive(256, "tokens per packed sequence (T)")
    batch_size: int = _positive(8, "sequences per optimizer step, across all devices (B)")
    micro_batches: int = _positive(1, "gradient accumulation: the batch is split into this many "
                                      "parts")
    steps: int = _positive(1000, "the schedule's horizon")
    learning_rate: float = setting(3e-4, type="float", above=0, doc="peak learning rate")
    schedule: str = setting("cosine", type="str", choices=SCHEDULES,
                            doc="cosine: warmup, cosine decay | wsd: warmup, stable, linear "
                                "decay | constant: warmup, then flat")
    warmup_steps: int = setting(100, type="int", at_least=0, doc="linear warmup from 0")
    min_lr_ratio: float = setting(0.1, type="float", at_least=0, at_most=1,
                                  doc="final learning rate / peak")
    decay_fraction: float = setting(0.2, type="float", above=0, at_most=1,
                                    doc="wsd: share of the steps spent decaying")
    b1: float = setting(0.9, type="float", at_least=0, at_most=1, doc="AdamW's first moment")
    b2: float = setting(0.95, type="float", at_least=0, at_most=1, doc="AdamW's second moment")
    eps: float = setting(1e-8, type="float", at_least=0, doc="AdamW's epsilon")
    mu_dtype: str | None = setting(None, type="str", choices=MU_DTYPES, null=True,
                                   doc="AdamW's first moment as stored; null: like the "
                                       "parameters (as the second is); bfloat16: rounded to "
                                       "bf16 after every update")
    weight_decay: float = setting(0.1, type="float", at_least=0,
                                  doc="AdamW, decoupled; never applied to norm gains and biases")
    clip_norm: float = setting(1.0, type="float", at_least=0,
                               doc="global gradient norm clip; 0: off")
    z_loss: float = setting(0.0, type="float", at_least=0,
                            doc="coefficient of log(Z)^2 (PaLM); 0: off")
    seed: int = setting(0, type="int", at_least=0, doc="parameter init and data order")
    log_every: int = _positive(10, "lr, tokens/s and MFU every this many steps (loss: every "
                                   "step)")
    eval_every: int = _positive(200, "validation loss every this many steps, and at the end")
    eval_batches: int = _positive(10, "validation batches per evaluation")
    checkpoint_every: int = _positive(200, "steps between checkpoints")
    keep_checkpoints: int = _positive(3, "checkpoints kept")
    max_nonfinite: int = _positive(5, "stop after this many non-finite steps in a row")
    peak_flops: float | None = setting(None, type="float", above=0, null=True,
                                       doc="per device, for MFU; null: a known table or "
                                           "measured")
    freeze: str = setting("none", type="str", choices=FREEZES,
                          doc="none | backbone: fine-tune the task head only")

    # Fields that only change bookkeeping: a run may resume with different values.
    RESUMABLE_CHANGES = ("steps", "log_every", "eval_every", "eval_batches", "checkpoint_every",
                         "keep_checkpoints", "max_nonfinite", "peak_flops")

    def __post_init__(self):
        check_settings(self)
        require(self.batch_size % self.micro_batches == 0, "micro_batches",
                self.micro_batches, f"must divide batch_size ({self.batch_size})")


DEFAULT_CORPUS = "/usr/share/doc/python3.11/html/_sources"


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One corpus of a weighted mixture (an entry of `data.sources`)."""

    path: str = setting(type="str", doc="a prepared dataset, or a raw corpus (as data.corpus)")
    weight: float = setting(type="float", above=0,
                            doc="its share of the training sequences, relative to the others'")
    name: str | None = setting(None, type="str", null=True,
                               doc="its validation metrics' suffix; null: the path's last part")

    def __post_init__(self):
        check_settings(self)
        if self.name is None:
            object.__setattr__(self, "name", Path(self.path.rstrip("/")).name or "source")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is split (the `data:` section)."""

    corpus: str = setting(DEFAULT_CORPUS, type="str",
                          doc="a prepared dataset (python -m llama_jax.data.prepare), or a raw "
                              "corpus: a directory (every file below it) or a glob, one "
                              "document each")
    sources: tuple[SourceConfig, ...] | None = setting(
        None, type="list", null=True,
        doc="a weighted mixture instead of corpus: a list of {path, weight, name}; the "
            "tokenizer is data.tokenizer, else the first source's")
    tokenizer: str | None = setting(None, type="str", null=True,
                                    doc="a tokenizer.model; null: train SentencePiece BPE on "
                                        "the corpus")
    val_fraction: float = setting(0.05, type="float", above=0, below=1,
                                  doc="share of documents held out for validation")
    max_tokenizer_chars: int = _positive(20_000_000, "text fed to tokenizer training (sampled "
                                                     "by document)")

    def __post_init__(self):
        check_settings(self)
        if self.sources is None:
            return
        require(isinstance(self.sources, (list, tuple)) and len(self.sources) > 0, "sources",
                self.sources, "must be a non-empty list of {path, weight} entries")
        sources = tuple(s if isinstance(s, SourceConfig) else
                        build_section(SourceConfig, _mapping(s, f"sources[{i}]"),
                                      f"sources[{i}]") for i, s in enumerate(self.sources))
        names = [s.name for s in sources]
        require(len(set(names)) == len(names), "sources", names,
                "must have distinct names (give each a name:)")
        object.__setattr__(self, "sources", sources)

    @property
    def corpora(self) -> tuple[SourceConfig, ...]:
        """What the run reads: the sources, or the corpus alone (weight 1)."""
        return self.sources or (SourceConfig(self.corpus, 1.0, "corpus"),)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.sources is None:  # a one-corpus run's file is as before mixtures
            del out["sources"]
        else:
            out["sources"] = [dataclasses.asdict(s) for s in self.sources]
        return out


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    require(isinstance(value, Mapping), where, value, "must be a mapping {path, weight, name}")
    return value


# Supervised fine-tuning on conversations: the LM head trained on the assistant's tokens
# (data/conversations.py), not a task head
CHAT = "chat"


def task_kinds() -> tuple[str, ...]:
    """The registered task heads' kinds (nn/heads.py), and chat."""
    return (*(name for name in HEADS if HEADS[name].task), CHAT)


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """A downstream task (the `task:` section; training/tasks.py, data/tasks.py): the head it
    puts on the model, and the JSONL files it reads — one example per line, with `text` and
    `label` (sequence_classification), `labels` per word (token_classification) or `target`
    (regression); or chat: conversations (`messages`) the LM head is fine-tuned on
    (data/conversations.py)."""

    kind: str = setting(type="str", choices=task_kinds,
                        doc="sequence_classification | token_classification | regression | "
                            "chat")
    train: str = setting(type="str", doc="a JSONL file")
    val: str | None = setting(None, type="str", null=True,
                              doc="a JSONL file; null: hold out val_fraction of train by hash")
    val_fraction: float = setting(0.1, type="float", above=0, below=1,
                                  doc="share of train held out when val is null")
    labels: Any = setting(1, type="any",
                          doc="classification: the class names (a label is a name or its "
                              "index) or their count; regression: the target names or count")
    pooling: str = setting("last", type="str", choices=POOLINGS,
                           doc="sequence_classification and regression: last | mean")
    packing: bool = setting(True, type="bool",
                            doc="chat: conversations packed into rows (attention within each); "
                                "false: one per row")
    truncate: bool = setting(False, type="bool",
                             doc="chat: cut a conversation longer than train.seq_len + 1 "
                                 "tokens; false: refuse it")

    def __post_init__(self):
        check_settings(self)
        names = self.labels
        if isinstance(names, (list, tuple)):
            require(all(isinstance(n, str) and n for n in names) and len(set(names)) == len(
                names), "labels", names, "must be distinct non-empty names (or a count)")
            object.__setattr__(self, "labels", tuple(names))
        else:
            require(isinstance(names, int) and not isinstance(names, bool) and names > 0,
                    "labels", names, "must be a list of names or a positive count")
        if self.kind == CHAT:
            return
        least = HEADS[self.kind].min_labels
        require(self.n_labels >= least, "labels", self.labels,
                f"must name at least {least} output(s) for kind {self.kind!r}")

    @property
    def n_labels(self) -> int:
        return len(self.labels) if isinstance(self.labels, tuple) else self.labels

    @property
    def label_names(self) -> tuple[str, ...] | None:
        return self.labels if isinstance(self.labels, tuple) else None

    def head_fields(self) -> dict[str, Any]:
        """The model fields of this task's head (chat: the LM head's)."""
        if self.kind == CHAT:
            return {"head": "lm"}
        return {"head": self.kind, "n_labels": self.n_labels, "label_names": self.label_names,
                "pooling": self.pooling if HEADS[self.kind].pooled else None}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (the `lora:` section; nn/lora.py): the run trains `A` and `B` beside
    each target weight of the init_from model, which stays frozen."""

    rank: int = _positive(8, "r: the adapters' inner width")
    alpha: float = setting(16.0, type="float", above=0,
                           doc="the adapters' output is scaled by alpha / rank")
    dropout: float = setting(0.0, type="float", at_least=0, below=1,
                             doc="dropout on the adapters' inputs while training")
    targets: Any = setting(("wq", "wv"), type="list",
                           doc="the layers' weights adapted, by their parameter names (wq, wk, "
                               "wv, wo, w_gate, w_up, w_down; MLA's likewise) or their paths' "
                               "ends (shared/w_gate: a MoE layer's shared experts)")

    def __post_init__(self):
        check_settings(self)
        targets = self.targets
        require(isinstance(targets, (list, tuple)) and targets and all(
            isinstance(t, str) and t for t in targets) and len(set(targets)) == len(targets),
            "targets", targets, "must be a non-empty list of distinct weight names")
        object.__setattr__(self, "targets", tuple(targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}


def _mesh_axis(default: int, doc: str) -> Any:
    return setting(default, type="int", doc=doc + "; -1: the devices left")


def _rules(doc: str) -> Any:
    return setting(None, type="mapping", null=True,
                   doc=doc + ": {logical axis: mesh axis | [mesh axes] | null}, merged over "
                             "the defaults")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes (their product is the device count; one may be -1: the rest) and the
    logical-axis rules (the `mesh:` section). Rules given here are merged over the default
    tables of the sharding module (`sharding.RULE_TABLES`) and
    stored as sorted `(logical axis, (mesh axes...))` tuples, so the config stays hashable."""

    data: int = _mesh_axis(-1, "data parallelism")
    fsdp: int = _mesh_axis(1, "fully sharded data parallelism (weights split over it)")
    tensor: int = _mesh_axis(1, "tensor parallelism (heads, FFN width, vocabulary)")
    expert: int = _mesh_axis(1, "expert parallelism: MoE experts split over it (a batch axis "
                                "elsewhere)")
    weight_rules: Any = _rules("weights and optimizer state")
    activation_rules: Any = _rules("activations")
    cache_rules: Any = _rules("the KV cache")

    def __post_init__(self):
        sizes = list(self.sizes)
        for name, size in zip(MESH_AXES, sizes):
            require(isinstance(size, int) and not isinstance(size, bool)
                    and (size > 0 or size == -1), name, size, "must be a positive integer or -1")
        require(sizes.count(-1) <= 1, "data", sizes, "at most one mesh axis may be -1")
        for name, (defaults, known) in RULE_TABLES.items():
            given = getattr(self, name) or {}
            if isinstance(given, tuple):  # already normalised (dataclasses.replace)
                given = dict(given)
            require(isinstance(given, Mapping), name, given,
                    "must map logical axis names to mesh axes")
            rules = []
            for axis, target in {**defaults, **given}.items():
                require(axis in known, name, axis,
                        f"is not a logical axis name; known: {', '.join(known)}")
                targets = [target] if isinstance(target, str) or target is None else target
                require(isinstance(targets, (list, tuple)) and all(
                    t is None or t in MESH_AXES for t in targets), f"{name}.{axis}", target,
                    f"must be a mesh axis ({', '.join(MESH_AXES)}), a list of them, or null")
                rules.append((axis, tuple(t for t in targets if t is not None)))
            object.__setattr__(self, name, tuple(sorted(rules)))

    @property
    def sizes(self) -> tuple[int, ...]:
        """The axis sizes in `MESH_AXES` order, as given (-1 unfilled)."""
        return tuple(getattr(self, name) for name in MESH_AXES)

    def shape_for(self, n_devices: int) -> tuple[int, ...]:
        """The sizes in `MESH_AXES` order with the -1 entry filled; the product must be
        `n_devices`."""
        sizes = list(self.sizes)
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if n_devices % known:
                raise ConfigError(f"mesh {dict(zip(MESH_AXES, sizes))}: the given sizes "
                                  f"(product {known}) do not divide the {n_devices} devices")
            sizes[sizes.index(-1)] = n_devices // known
        if math.prod(sizes) != n_devices:
            raise ConfigError(f"mesh {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} "
                              f"devices; this run has {n_devices}")
        return tuple(sizes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in RULE_TABLES:
            out[name] = {axis: list(targets) for axis, targets in getattr(self, name)}
        return out


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a training run is defined by: the model, its optimisation and its data."""

    model: ModelConfig
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = MeshConfig()
    task: TaskConfig | None = None  # a downstream task; None: language modelling on data
    init_from: str | None = None  # a checkpoint the parameters start from (finetune.py)
    lora: LoraConfig | None = None  # adapters trained on the frozen init_from model

    def __post_init__(self):
        if self.task is not None:
            for name, value in self.task.head_fields().items():
                require(getattr(self.model, name) == value, f"model.{name}",
                        getattr(self.model, name), f"is set by the task section ({value!r})")
        require(self.init_from is None or (isinstance(self.init_from, str) and self.init_from),
                "init_from", self.init_from, "must be a checkpoint directory")
        if self.lora is not None:
            require(self.init_from is not None, "lora", self.lora.to_dict(),
                    "adapts a trained model: set init_from (the base the adapters train on)")
            require(self.task is None or self.task.kind == CHAT, "lora", self.lora.to_dict(),
                    "adapts a language model (a chat task, or none); task "
                    f"{self.task and self.task.kind!r} trains a head (use train.freeze)")
            require(self.train.freeze == "none", "train.freeze", self.train.freeze,
                    "must be none with lora: (the base is frozen, the adapters train)")

    def to_dict(self) -> dict[str, Any]:
        out = {"model": self.model.to_dict(), "train": dataclasses.asdict(self.train),
               "data": self.data.to_dict(), "mesh": self.mesh.to_dict()}
        if self.train.freeze == "none":  # a pretraining run's file is as before fine-tuning
            del out["train"]["freeze"]
        if self.task is not None:
            out["task"] = dataclasses.asdict(self.task)
            if isinstance(self.task.labels, tuple):
                out["task"]["labels"] = list(self.task.labels)
            if self.task.kind != CHAT:  # a task head run's file is as before chat runs
                for name in ("packing", "truncate"):
                    del out["task"][name]
        if self.init_from is not None:
            out["init_from"] = self.init_from
        if self.lora is not None:
            out["lora"] = self.lora.to_dict()
        return out

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any], where: str) -> "RunConfig":
        """From a merged YAML tree; `where` (the file) prefixes error messages. With a `task:`
        section, the model's head fields come from the task."""
        if "model" not in tree:
            raise ConfigError(f"{where}: no `model:` section (directly or through `base:`)")
        sections = {}
        for name, build in (("task", functools.partial(build_section, TaskConfig)),
                            ("model", ModelConfig.from_dict),
                            ("train", functools.partial(build_section, TrainConfig)),
                            ("data", functools.partial(build_section, DataConfig)),
                            ("mesh", functools.partial(build_section, MeshConfig)),
                            ("lora", functools.partial(build_section, LoraConfig))):
            fields = tree.get(name) or {}
            if not isinstance(fields, Mapping):
                raise ConfigError(f"{where}: `{name}:` must be a mapping, got {fields!r}")
            if (name == "task" and not fields) or (name == "lora" and tree.get(name) is None):
                continue  # no task: language modelling; no lora: every weight trains
            if name == "model" and "task" in sections:
                fields = with_task_head(fields, sections["task"])
            try:
                sections[name] = build(fields, where=name)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
        try:
            return cls(**sections, init_from=tree.get("init_from"))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


def with_task_head(model: Mapping[str, Any], task: TaskConfig) -> dict[str, Any]:
    """A model section with the task's head; head fields the section sets differently are
    refused (the task section owns them)."""
    head = task.head_fields()
    for name, value in model.items():
        if name in head and value != head[name] and not (
                name == "label_names" and list(value or ()) == list(head[name] or ())):
            raise ConfigError(f"model.{name}={value!r}: the task section sets it "
                              f"({head[name]!r}); remove it from `model:`")
    return {**model, **head}


def parse_mesh(text: str) -> MeshConfig:
    """A `--mesh data=D,fsdp=F,tensor=T[,expert=E]` flag's mesh (data defaults to 1; every size
    given: the CLIs that take it plan or compile without the devices to fill -1 from)."""
    sizes = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in MESH_AXES or not value.lstrip("-").isdigit():
            raise ConfigError(f"--mesh {text!r}: expected data=D,fsdp=F,tensor=T[,expert=E] "
                              f"(axes {', '.join(MESH_AXES)})")
        sizes[name] = int(value)
    mesh = MeshConfig(**{"data": 1, **sizes})
    if -1 in mesh.sizes:
        raise ConfigError(f"--mesh {text!r}: give every size (the planner has no devices "
                          "to fill -1 from)")
    return mesh
