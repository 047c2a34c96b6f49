"""The API page's parameter tables (a griffe extension that mkdocstrings loads, mkdocs.yml).

A policy's, an allocation's or a metric's parameters are dataclass fields whose meaning, range
and the meaning of ``None`` are written once, beside the field (``param(…, help=…)``,
kvscope.params). This extension lists them in the class's docstring as an ``Attributes``
section — every field, inherited ones too, the class's own first — and gives each field its
default as written by Python (``32``, not ``param(defaults.HORIZON, …)``), so the rendered
signature reads ``FMM(horizon=32, …)``. The same texts make ``kvscope policies`` and
``kvscope analyze METRIC --help``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import griffe

from kvscope.params import ParamSpec, specs


def field_line(name: str, annotation: str, spec: ParamSpec, default: Any) -> str:
    """One entry of the ``Attributes`` section: ``name (type): help; range; None: meaning.``"""
    parts = [spec.help or name]
    if spec.requirement():
        parts.append(f"must {spec.requirement()}")
    if default is None and spec.none:
        parts.append(f"None: {spec.none}")
    return f"{name} ({annotation}): {'; '.join(parts)}."


def attributes_section(cls: type) -> str:
    """The ``Attributes`` section of the parameter fields of ``cls`` (empty when it has none)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    params = specs(cls)
    own = [name for name in vars(cls).get("__annotations__", {}) if name in params]
    order = own + [name for name in params if name not in own]
    lines = [field_line(name, str(fields[name].type), params[name][0], params[name][3]) for name in order]
    return "Attributes:\n" + "\n".join(f"    {line}" for line in lines) if lines else ""


class ParamFields(griffe.Extension):
    """Parameter fields of kvscope's dataclasses, documented from their ``param`` specs."""

    def on_class(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if not cls.path.startswith("kvscope."):
            return
        try:
            runtime = getattr(importlib.import_module(cls.module.path), cls.name)
        except (ImportError, AttributeError):
            return
        if not (isinstance(runtime, type) and dataclasses.is_dataclass(runtime)):
            return
        if not any("param" in f.metadata for f in dataclasses.fields(runtime)):
            return
        defaults = {name: repr(default) for name, (_spec, _kind, _optional, default) in specs(runtime).items()}
        init = cls.members.get("__init__")
        for name, default in defaults.items():
            if isinstance(member := cls.members.get(name), griffe.Attribute):
                member.value = default
            if isinstance(init, griffe.Function) and name in init.parameters:
                init.parameters[name].default = default
        section = attributes_section(runtime)
        if not section:
            return
        if cls.docstring is None:
            cls.docstring = griffe.Docstring(section, parent=cls)
        else:
            cls.docstring.value = f"{cls.docstring.value.rstrip()}\n\n{section}"
