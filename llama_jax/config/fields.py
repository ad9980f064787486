"""The validation toolkit of the config schemas: each field declares its type, range, choices,
role and documentation once (`setting`), and `check_settings` enforces the declarations; checks
that relate several fields stay in the schemas' `__post_init__`. Every error is a `ConfigError`
naming the field and the value; a section built from a file (`build_section`) prefixes its
errors with the section's name. The config reference (docs/config-reference.md) is generated
from the same declarations (`reference_rows`).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Mapping

from llama_jax.dtypes import DTYPES, dtype_name
from llama_jax.errors import ConfigError

# Field roles: "architecture" fields (no role) change the function the model computes;
# "execution" fields only change how it runs (a run may resume, a checkpoint may load, under
# other values); "generation" fields are defaults for sampling; "init" fields only size or
# initialise the parameters (ffn_dim is resolved from them), so a checkpoint does not carry
# them; "names" fields only name the head's outputs.
ROLES = ("execution", "generation", "init", "names")
# "section", "list", "mapping" and "any" values are checked by their schema's own code.
TYPES = ("int", "float", "bool", "str", "dtype", "section", "list", "mapping", "any")


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a field accepts. `above`/`at_least` and `below`/`at_most` bound numbers (exclusive,
    inclusive); `choices` is a tuple, or a function giving one (a registry's names); `null`
    allows None, which the schema resolves to a default or reads as "off"."""

    type: str
    above: float | None = None
    at_least: float | None = None
    below: float | None = None
    at_most: float | None = None
    choices: tuple | Callable[[], tuple] | None = None
    null: bool = False

    def options(self) -> tuple | None:
        return self.choices() if callable(self.choices) else self.choices

    def describe(self) -> str:
        """The accepted values in words: "int > 0", "float in [0, 1]", "one of a, b"."""
        if self.options() is not None:
            text = "one of " + ", ".join(str(c) for c in self.options())
        elif self.type == "dtype":
            text = "one of " + ", ".join(DTYPES)
        else:
            low = (f"({_number(self.above)}" if self.above is not None else
                   f"[{_number(self.at_least)}" if self.at_least is not None else None)
            high = (f"{_number(self.below)})" if self.below is not None else
                    f"{_number(self.at_most)}]" if self.at_most is not None else None)
            if low is not None and high is not None:
                text = f"{self.type} in {low}, {high}"
            elif low is not None:
                text = f"{self.type} {'>' if low[0] == '(' else '>='} {low[1:]}"
            elif high is not None:
                text = f"{self.type} {'<' if high[-1] == ')' else '<='} {high[:-1]}"
            else:
                text = self.type
        return text + (" or null" if self.null else "")

    def problem(self, value: Any) -> str | None:
        """Why `value` is not accepted (the end of an error message), or None."""
        if value is None:
            return None if self.null else "must be given"
        if self.type == "bool":
            return None if isinstance(value, bool) else "must be true or false"
        if self.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            return ("must be a positive integer" if self.above == 0 else
                    "must be a non-negative integer" if self.at_least == 0 else
                    "must be an integer")
        if self.type == "str" and not (isinstance(value, str) and value):
            return "must be a non-empty string"
        options = self.options()
        if options is not None:
            return None if value in options else f"is not one of {options}"
        if self.type in ("int", "float"):
            return self._range_problem(value)
        return None

    def _range_problem(self, value: float) -> str | None:
        ok = ((self.above is None or value > self.above)
              and (self.at_least is None or value >= self.at_least)
              and (self.below is None or value < self.below)
              and (self.at_most is None or value <= self.at_most))
        if ok:
            return None
        if self.type == "int" and (self.below, self.at_most) == (None, None) and (
                self.above, self.at_least) in (
                (0, None), (None, 0)):
            return "must be a " + ("positive" if self.above == 0 else "non-negative") + \
                " integer"
        words = self.describe().removesuffix(" or null")
        return "must be " + words.split(" ", 1)[1]


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def setting(default: Any = dataclasses.MISSING, *, type: str, doc: str, role: str | None = None,
            above: float | None = None, at_least: float | None = None,
            below: float | None = None, at_most: float | None = None, choices: tuple | Callable[[], tuple] | None = None,
            null: bool = False) -> Any:
    """A dataclass field with its rule, role and documentation in the metadata."""
    assert type in TYPES and (role is None or role in ROLES), (type, role)
    rule = Rule(type, above, at_least, below, at_most, choices, null)
    metadata = {"rule": rule, "doc": doc, **({"role": role} if role else {})}
    return dataclasses.field(default=default, metadata=metadata)


def check_settings(obj: Any, prefix: str = "") -> None:
    """Checks every declared field of a config dataclass against its rule, normalising on the
    way: numbers given as ints or strings become floats (YAML 1.1 reads `1e-5` as a string)
    and dtypes their names. Errors name `prefix + field`."""
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("rule")
        if rule is None:
            continue
        name, value = prefix + f.name, getattr(obj, f.name)
        if value is not None and rule.type == "float":
            value = as_float(name, value)
        elif value is not None and rule.type == "dtype":
            value = dtype_name(value, name)
        object.__setattr__(obj, f.name, value)
        problem = rule.problem(value)
        if problem is not None:
            raise ConfigError(f"{name}={value!r} {problem}")


def reference_rows(cls: type) -> list[tuple[str, str, Any, str, str]]:
    """(field, accepts, default, role, doc) for each declared field of a config dataclass; the
    default is `dataclasses.MISSING` for a required field."""
    return [(f.name, f.metadata["rule"].describe(), f.default, f.metadata.get("role",
                                                                              "architecture"),
             f.metadata["doc"]) for f in dataclasses.fields(cls) if "rule" in f.metadata]


def build_section(cls: type, fields: Mapping[str, Any], where: str):
    """`cls(**fields)` with unknown or missing keys and bad values reported as `where.field`."""
    try:
        check_keys(fields, cls, where)
        return cls(**fields)
    except ConfigError as e:
        if str(e).startswith(where):  # from check_keys
            raise
        raise ConfigError(f"{where}.{e}") from None
    except TypeError as e:  # e.g. a YAML list where a number belongs
        raise ConfigError(f"{where}: {e}") from None


def as_float(field: str, value: Any) -> float | None:
    """Accepts ints and numeric strings: YAML 1.1 reads `1e-5` (no dot) as a string."""
    if value is None or isinstance(value, float):
        return value
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{field}={value!r} must be a number") from None


def check_keys(fields: Mapping[str, Any], cls: type, where: str) -> None:
    known = [f.name for f in dataclasses.fields(cls)]
    for key in fields:
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{where}: unknown key {key!r}{suggestion}; known keys: "
                              f"{', '.join(known)}")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.name not in fields]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {', '.join(missing)}")
