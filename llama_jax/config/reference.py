"""The config field reference, generated from the schemas' declarations (`setting`): one table
per section with what each field accepts, its default, its role and its meaning.

    python -m llama_jax.config.reference            # print it
    python -m llama_jax.config.reference --write    # regenerate docs/config-reference.md

A test fails when docs/config-reference.md and the code disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from llama_jax.config.fields import ROLES, reference_rows
from llama_jax.config.model import MlaConfig, ModelConfig, MoeConfig, RopeScaling
from llama_jax.config.run import (DataConfig, LoraConfig, MeshConfig, SourceConfig, TaskConfig,
                                  TrainConfig)

DOCUMENT = Path(__file__).resolve().parent.parent.parent / "docs" / "config-reference.md"
SECTIONS = (("model", ModelConfig), ("model.rope_scaling", RopeScaling), ("model.mla", MlaConfig),
            ("model.moe", MoeConfig), ("train", TrainConfig), ("data", DataConfig),
            ("data.sources[]", SourceConfig), ("mesh", MeshConfig), ("task", TaskConfig),
            ("lora", LoraConfig))


def render() -> str:
    lines = ["# Config reference", "",
             "Every field of a run config file, section by section, generated from the config "
             "classes (`python -m llama_jax.config.reference --write`; a test keeps this file "
             "and the code in step). How files inherit and override each other: "
             "[configs.md](configs.md).", "",
             "Roles: *architecture* fields change the function the model computes; "
             f"{', '.join(f'*{r}*' for r in ROLES)} fields do not: *execution* fields change "
             "only how it runs (a run may resume, a checkpoint may load, under other values), "
             "*generation* fields are sampling defaults, *init* fields only size or initialise "
             "new parameters, *names* fields only name a head's outputs.", ""]
    for name, cls in SECTIONS:
        roles = name.startswith("model")  # roles are the model's (what a checkpoint carries)
        columns = ("field", "accepts", "default", *(("role",) if roles else ()), "meaning")
        lines += [f"## `{name}:`", "", cls.__doc__.split("\n\n")[0].replace("\n    ", " "), "",
                  "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
        for field, accepts, default, role, doc in reference_rows(cls):
            cells = (f"`{field}`", accepts, _default(default), *((role,) if roles else ()), doc)
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _default(value) -> str:
    """A default as it would be written in YAML."""
    if value is dataclasses.MISSING:
        return "required"
    text = value if isinstance(value, str) else json.dumps(
        list(value) if isinstance(value, tuple) else value)
    return f"`{text}`"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOCUMENT}")
    if parser.parse_args(argv).write:
        DOCUMENT.write_text(render())
    else:
        print(render(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
