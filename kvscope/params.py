"""Parameters whose type and allowed range stand beside their field, checked on construction.

    @dataclass
    class H2O(Policy):
        recent_frac: float = param(0.5, low=0, high=1, help="share of the capacity kept for the newest tokens")

    check_params(policy)          # in __post_init__: every field against its spec, values normalized
    parse_param(cls, name, text)  # the CLI's text → a value of the field's type

The field's annotation gives the type (``int | None`` = an integer or None); ``param`` gives
the range. A value out of range raises a [`KvscopeError`][kvscope.errors.KvscopeError] that names the owner, the
parameter (by its CLI flag where it has one), what is allowed and the value, e.g.
``h2o parameter recent_frac must lie in [0, 1] (got -1.0)`` or ``fmm --horizon must be ≥ 1
(got 0)``. Floats must be finite; integers must be integers (not bools).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import KvscopeError


@dataclass(frozen=True)
class ParamSpec:
    """What a parameter may hold; see ``param``."""

    help: str = ""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    multiple_of: int | None = None
    choices: tuple | None = None
    flag: str | None = None  # CLI flag (default ``--name-with-dashes``)
    cli: bool = True  # offered on the command line
    none: str = ""  # what None means, for help texts ("the trace's")
    tune: tuple | None = None  # what kvscope tune searches by default: (low, high) of a float, values otherwise

    def cli_flag(self, name: str) -> str:
        """``--name-with-dashes`` unless the field names its flag."""
        return self.flag or "--" + name.replace("_", "-")

    def label(self, name: str, by_flag: bool = False) -> str:
        """How messages name the parameter: by its CLI flag (metrics, whose parameters are
        command-line options) or as ``parameter name`` (policies: ``name:key=value``)."""
        return self.cli_flag(name) if by_flag else f"parameter {name}"

    def requirement(self) -> str:
        """What ``must`` … of the range: ``lie in (0, 1]``, ``be ≥ 1``, ``be one of window, token``."""
        if self.choices is not None:
            return "be one of " + ", ".join(map(str, self.choices))
        if self.multiple_of and self.low == self.multiple_of and self.high is None:
            return f"be a positive multiple of {self.multiple_of}"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"lie in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            text = f"be {'>' if self.low_open else '≥'} {_num(self.low)}"
        elif self.high is not None:
            text = f"be {'<' if self.high_open else '≤'} {_num(self.high)}"
        else:
            text = ""
        if self.multiple_of:
            text = f"{text} and a multiple of {self.multiple_of}" if text else f"be a multiple of {self.multiple_of}"
        return text


KIND_REQUIREMENT = {
    int: "be an integer",
    float: "be a finite number",
    bool: "be true or false",
    str: "be text",
    tuple: "list indices ≥ 0 (e.g. 0,3,5 or 10-15)",
}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def param(default: Any = dataclasses.MISSING, **spec) -> Any:
    """A dataclass field with a ``ParamSpec`` (``low``, ``high``, ``low_open``,
    ``high_open``, ``multiple_of``, ``choices``, ``help``, ``flag``, ``cli``, ``none``, ``tune``)."""
    return field(default=default, metadata={"param": ParamSpec(**spec)})


@functools.cache
def _kinds(cls: type) -> dict[str, tuple[type, bool]]:
    """``{field: (kind, None allowed)}`` from the annotations of ``cls``."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name, Any)
        options = hint_options(hint)
        optional = type(None) in options
        kinds = [a for a in options if a is not type(None)] or [hint]
        kind = typing.get_origin(kinds[0]) or kinds[0]
        out[f.name] = (kind, optional)
    return out


_UnionType = type(int | None)


def hint_options(hint) -> list:
    """The members of a union annotation (``int | None`` → ``[int, NoneType]``), else ``[hint]``."""
    return list(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, _UnionType) else [hint]


def specs(cls) -> dict[str, tuple[ParamSpec, type, bool, Any]]:
    """``{name: (spec, kind, None allowed, default)}`` of every parameter field of ``cls``."""
    cls = cls if isinstance(cls, type) else type(cls)
    kinds = _kinds(cls)
    return {
        f.name: (f.metadata["param"], *kinds[f.name], f.default)
        for f in dataclasses.fields(cls)
        if "param" in f.metadata
    }


def owner_name(obj) -> str:
    return str(getattr(obj, "name", type(obj).__name__))


def check_value(owner: str, name: str, value, spec: ParamSpec, kind: type, optional: bool, by_flag: bool = False):
    """``value`` normalized to ``kind`` (int → float, list → tuple), or a ``KvscopeError`` naming
    the owner, the parameter, what it must be and the value."""

    def refuse(requirement: str):
        return KvscopeError(f"{owner} {spec.label(name, by_flag)} must {requirement} (got {value!r})")

    if value is None:
        if optional:
            return None
        raise refuse(KIND_REQUIREMENT.get(kind, "be given"))
    if kind is bool:
        if not isinstance(value, (bool, _np_bool())):
            raise refuse(KIND_REQUIREMENT[bool])
        return bool(value)
    if kind is tuple:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise refuse(KIND_REQUIREMENT[tuple])
        items = list(value)
        if not items or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0 for x in items):
            raise refuse(KIND_REQUIREMENT[tuple])
        return tuple(int(x) for x in items)
    if kind is str:
        if not isinstance(value, str):
            raise refuse(KIND_REQUIREMENT[str])
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise refuse(KIND_REQUIREMENT[int])
        value = int(value)
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise refuse(KIND_REQUIREMENT[float])
        value = float(value)
    if not _in_range(value, spec):
        raise refuse(spec.requirement())
    return value


def _in_range(value, spec: ParamSpec) -> bool:
    if spec.low is not None and (value < spec.low or (spec.low_open and value == spec.low)):
        return False
    if spec.high is not None and (value > spec.high or (spec.high_open and value == spec.high)):
        return False
    if spec.multiple_of and value % spec.multiple_of:
        return False
    return spec.choices is None or value in spec.choices


def _np_bool():
    import numpy as np

    return np.bool_


def by_flag(obj) -> bool:
    """Messages name the parameters of ``obj`` by their CLI flags (``cli_flags = True`` on its class)."""
    return bool(getattr(obj if isinstance(obj, type) else type(obj), "cli_flags", False))


def check_params(obj) -> None:
    """Check and normalize every parameter field of ``obj`` (a dataclass, frozen or not)."""
    owner, flags = owner_name(obj), by_flag(obj)
    for name, (spec, kind, optional, _default) in specs(obj).items():
        value = check_value(owner, name, getattr(obj, name), spec=spec, kind=kind, optional=optional, by_flag=flags)
        object.__setattr__(obj, name, value)


def parse_param(cls, name: str, text: str):
    """The text of ``name=text`` (CLI) → a value of the field's type (range checked on construction)."""
    spec, kind, optional, _default = specs(cls)[name]
    owner = owner_name(cls)
    text = text.strip()
    if optional and text.lower() == "none":
        return None
    try:
        return parse_text(kind, text)
    except ValueError:
        requirement = KIND_REQUIREMENT.get(kind, "be valid")
        raise KvscopeError(f"{owner} {spec.label(name, by_flag(cls))} must {requirement} (got {text!r})") from None


def parse_text(kind: type, text: str):
    """``text`` as a value of ``kind`` (int, float, bool, tuple of indices; anything else stays
    text); ``ValueError`` when it is not one."""
    return _PARSERS.get(kind, str)(text)


def split_outside_brackets(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` where no ``[`` is open: ``a:b=[c:d,e]`` at ``:`` → ``a``, ``b=[c:d,e]``
    (a list inside a policy's parameter, e.g. a press's ``presses=[…]``)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if depth < 0:
            raise KvscopeError(f"unbalanced brackets in {text!r}")
        if char == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise KvscopeError(f"unbalanced brackets in {text!r}")
    return [*parts, text[start:]]


def parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ValueError(text)


def parse_indices(text: str) -> tuple[int, ...] | None:
    """``0,3,5`` or ``10-15`` (inclusive) or ``all`` (None) → indices."""
    if text.lower() == "all":
        return None
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        out += list(range(int(lo), int(hi) + 1)) if sep else [int(part)]
    if not out:
        raise ValueError(text)
    return tuple(out)


_PARSERS: dict[type, Callable[[str], Any]] = {int: int, float: float, bool: parse_bool, tuple: parse_indices}


def field_values(obj) -> dict:
    """``{field: value}`` of a dataclass (a policy's or an allocation's parameters)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def spelled(obj) -> str:
    """``name`` or ``name:key=value:…`` for the fields of ``obj`` that differ from their defaults,
    spelled as the command line takes them (``evict=true``), so that ``parse_spelled`` gives
    the object back (policies, allocations)."""
    defaults = field_values(type(obj)())
    changed = [
        f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in field_values(obj).items() if v != defaults[k]
    ]
    return ":".join([obj.name, *changed])


def registered(registry: dict[str, type], what: str, name: str) -> type:
    """The class ``name`` of ``registry`` (``what``: "policy", "allocation" for messages)."""
    if name not in registry:
        raise KvscopeError(f"unknown {what} {name!r} (available: {', '.join(registry)})")
    return registry[name]


def _check_known(cls: type, what: str, keys) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(keys) - known)
    if unknown:
        raise KvscopeError(
            f"{what} {cls.name} has no parameter {unknown[0]!r} (has: {', '.join(sorted(known)) or 'none'})"
        )


def make_registered(registry: dict[str, type], what: str, name: str, **params):
    """The ``what`` called ``name`` with ``params`` as its fields (each checked on construction)."""
    cls = registered(registry, what, name)
    _check_known(cls, what, params)
    return cls(**params)


def parse_spelled(registry: dict[str, type], what: str, text: str):
    """``"name"`` or ``"name:key=value:key=value"`` → the registered object."""
    name, *pairs = text.strip().split(":")
    cls = registered(registry, what, name)
    params = {}
    for pair in pairs:
        if "=" not in pair:
            raise KvscopeError(f"{what} parameter {pair!r} must read key=value")
        key, value = pair.split("=", 1)
        _check_known(cls, what, [key])
        params[key] = parse_param(cls, key, value)
    return cls(**params)
