"""The API reference is complete and renders cleanly.

Walking the public API (the ``__all__`` of kvscope and of its public packages, and every object
the API page names): each function, class, method and property has a docstring; each parameter
of a documented function has a type annotation and an entry in its docstring's ``Args``
(classes: their fields under ``Attributes``, or the ``help`` of their ``param`` spec; a method
without a docstring of its own is documented by the one it overrides). The API page itself is
built (mkdocs, strictly: a griffe warning or a cross-reference that does not resolve fails it)
and read: no raw Sphinx role (``:class:`…```) is left in it, every public name has its entry,
and every parameter field of every registered policy, allocation and metric is listed in its
class's table. (The page alone: the full site executes the notebooks, minutes; ``make docs``.)
"""

from __future__ import annotations

import dataclasses
import functools
import html
import importlib
import inspect
import os
import re
import subprocess
import sys
import types
import zlib
from pathlib import Path

import pytest
import yaml
from griffe import Docstring, DocstringSectionKind

from kvscope.analysis.registry import METRICS
from kvscope.params import specs
from kvscope.policies import REGISTRY as POLICIES
from kvscope.policies.allocation import REGISTRY as ALLOCATIONS

ROOT = Path(__file__).resolve().parents[1]
API_PAGE = ROOT / "docs" / "api.md"
PACKAGES = [
    "kvscope",
    "kvscope.analysis",
    "kvscope.policies",
    "kvscope.live",
    "kvscope.replay",
    "kvscope.report",
    "kvscope.plots",
    "kvscope.workloads",
    "kvscope.errors",
]
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|ref)s?:`")
ARG_SECTIONS = (DocstringSectionKind.parameters, DocstringSectionKind.other_parameters)


def _resolve(path: str):
    """The object at a dotted path (``kvscope.analysis.fmm.fmm``: the function, not the module)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def page_paths() -> list[str]:
    """The dotted paths the API page renders (``::: path``)."""
    return re.findall(r"^::: ([\w.]+)", API_PAGE.read_text(), flags=re.MULTILINE)


def public_objects() -> dict[str, object]:
    """``{name: object}`` of every public function and class: each package's ``__all__``, and what
    the API page renders by path (an object, or a module's ``__all__`` or public members); one
    name per object."""
    found: dict[str, object] = {}
    seen: set[int] = set()
    named = [(f"{p}.{n}", getattr(importlib.import_module(p), n)) for p in PACKAGES for n in _exports(p)]
    for path in page_paths():
        obj = _resolve(path)
        if isinstance(obj, types.ModuleType):
            named += [(f"{path}.{n}", getattr(obj, n)) for n in _exports(path)]
        else:
            named.append((path, obj))
    for name, obj in named:
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and id(obj) not in seen:
            seen.add(id(obj))
            found[name] = obj
    return found


def _exports(package: str) -> list[str]:
    """A module's ``__all__``, else the public names it defines itself."""
    module = importlib.import_module(package)
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [n for n, v in vars(module).items() if not n.startswith("_") and getattr(v, "__module__", None) == package]


def _own_members(cls: type):
    """Public methods and properties ``cls`` defines itself, but not those that implement a
    third-party base's method (transformers' ``Cache`` API: documented there)."""
    for name, value in vars(cls).items():
        kinds = (types.FunctionType, staticmethod, classmethod, property, functools.cached_property)
        if name.startswith("_") or not isinstance(value, kinds):
            continue
        foreign = [b for b in cls.__mro__[1:] if hasattr(b, name) and not b.__module__.startswith("kvscope")]
        if not foreign:
            yield name, value


def documented_names(doc: str | None, kinds=ARG_SECTIONS) -> set[str]:
    """Names the Google-style sections ``kinds`` of a docstring list."""
    names: set[str] = set()
    sections = Docstring(doc or "", parser="google").parse(warn_missing_types=False, warn_unknown_params=False)
    for section in sections:
        if section.kind in kinds:
            names |= {item.name.lstrip("*") for item in section.value}
    return names


def function_problems(name: str, fn, doc: str | None) -> list[str]:
    if not doc:
        return [f"{name}: no docstring"]
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    documented = documented_names(doc)
    problems = []
    for p in parameters:
        if p.name in ("self", "cls"):
            continue
        if p.name not in documented:
            problems.append(f"{name}: parameter {p.name} not in the docstring's Args")
        if p.annotation is inspect.Parameter.empty:
            problems.append(f"{name}: parameter {p.name} has no type annotation")
    return problems


def class_problems(name: str, cls: type) -> list[str]:
    if not (cls.__doc__ or "").strip() or cls.__doc__.startswith(f"{cls.__name__}("):  # dataclass's own
        return [f"{name}: no docstring"]
    problems = []
    doc = inspect.cleandoc(cls.__doc__)
    if dataclasses.is_dataclass(cls):
        listed = documented_names(doc, (DocstringSectionKind.attributes, *ARG_SECTIONS))
        params = specs(cls) if any("param" in f.metadata for f in dataclasses.fields(cls)) else {}
        for f in dataclasses.fields(cls):
            has_help = f.name in params and params[f.name][0].help
            if f.init and not f.name.startswith("_") and f.name not in listed and not has_help:
                problems.append(f"{name}: field {f.name} is not listed under Attributes")
    elif "__init__" in vars(cls):  # the constructor's arguments: the class docstring's Args
        problems += function_problems(f"{name}.__init__", cls.__init__, doc)
    for member, value in _own_members(cls):
        label = f"{name}.{member}"
        if isinstance(value, (property, functools.cached_property)):
            problems += [] if (value.__doc__ or "").strip() else [f"{label}: no docstring"]
            continue
        fn = getattr(cls, member)
        if not (inspect.unwrap(fn).__doc__ or "").strip():  # an override documented by the method it overrides
            problems += [] if inspect.getdoc(fn) else [f"{label}: no docstring"]
            continue
        problems += function_problems(label, fn, inspect.getdoc(fn))
    return problems


def test_every_public_name_has_a_docstring_with_typed_documented_parameters():
    objects = public_objects()
    assert len(objects) > 80 and {"kvscope.trace", "kvscope.TraceSettings", "kvscope.analysis.FMM"} <= set(objects)
    problems = []
    for name, obj in objects.items():
        if inspect.isclass(obj):
            problems += class_problems(name, obj)
        else:
            problems += function_problems(name, obj, inspect.getdoc(obj))
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_the_walk_finds_what_is_missing():
    """The checks above on objects made to fail them."""

    def plain(x, y: int):
        """No Args."""

    def typed(x: int) -> None:
        """Typed and documented.

        Args:
            x: A number.
        """

    @dataclasses.dataclass
    class Fields:
        """A class whose field ``a`` is not listed."""

        a: int = 0

    assert function_problems("plain", plain, inspect.getdoc(plain)) == [
        "plain: parameter x not in the docstring's Args",
        "plain: parameter x has no type annotation",
        "plain: parameter y not in the docstring's Args",
    ]
    assert function_problems("typed", typed, inspect.getdoc(typed)) == []
    assert class_problems("Fields", Fields) == ["Fields: field a is not listed under Attributes"]


# -- the rendered page --------------------------------------------------------------------------


def _python_tags(loader, suffix, node):
    return None


@pytest.fixture(scope="module")
def api_site(tmp_path_factory) -> Path:
    """The API page built alone, with the project's mkdocstrings settings (mkdocs.yml), strictly:
    only links to the site's other pages are not checked here (the full ``make docs`` does)."""
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_multi_constructor("tag:yaml.org,2002:python/", _python_tags)
    project = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=loader)  # the python tags dropped
    plugin = next(p["mkdocstrings"] for p in project["plugins"] if isinstance(p, dict) and "mkdocstrings" in p)
    python = plugin["handlers"]["python"]
    python["paths"] = [str(ROOT)]
    options = python["options"]
    options["extensions"] = [str(ROOT / e) if e.startswith("docs/") else e for e in options["extensions"]]
    folder = tmp_path_factory.mktemp("api-site")
    (folder / "docs").mkdir()
    (folder / "docs" / "index.md").write_text(API_PAGE.read_text())
    config = {
        "site_name": "api",
        "docs_dir": "docs",
        "strict": True,
        "theme": {"name": "mkdocs"},
        "markdown_extensions": [e for e in project["markdown_extensions"] if not isinstance(e, dict) or "toc" not in e]
        + [{"toc": {"permalink": True}}],
        "plugins": [{"mkdocstrings": plugin}],
        "validation": {"links": {"not_found": "info", "anchors": "info", "unrecognized_links": "info"}},
    }
    (folder / "mkdocs.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(folder / "site")],
        cwd=folder, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder / "site"


def _text(page: str) -> str:
    """The page's prose: tags, code spans and code blocks removed."""
    article = re.sub(r"<pre.*?</pre>|<code.*?</code>", " ", page, flags=re.DOTALL)
    return html.unescape(re.sub(r"<[^>]+>", " ", article))


def _inventory(site: Path) -> set[str]:
    data = (site / "objects.inv").read_bytes()
    body = zlib.decompress(data.split(b"compressed using zlib.\n", 1)[1]).decode()
    return {line.split()[0] for line in body.splitlines()}


def test_the_api_page_has_no_raw_roles_and_an_entry_for_every_public_name(api_site):
    page = (api_site / "index.html").read_text()
    raw = [m.group(0) for m in ROLE.finditer(_text(page))]
    assert not raw, raw[:10]
    shown = html.unescape(re.sub(r"<[^>]+>", " ", page))
    assert "``" not in shown  # reST literals: Markdown code spans, never shown (code blocks too)
    rendered = _inventory(api_site)
    missing = [
        name
        for name, obj in public_objects().items()
        if name not in rendered and f"{obj.__module__}.{obj.__qualname__}" not in rendered
    ]
    assert not missing, missing


def _listed(section: str, name: str) -> bool:
    """``name`` is a row of a parameter or attribute table of ``section``."""
    return re.search(rf"<td><code>(<span[^>]*>)?{re.escape(name)}(</span>)?</code></td>", section) is not None


def _section(page: str, anchor: str) -> str:
    """The part of the page from ``anchor``'s heading to the next object that is not its member."""
    ids = [(m.start(), m.group(1)) for m in re.finditer(r'id="(kvscope[\w.]*)"', page)]
    start = next(i for i, (_, name) in enumerate(ids) if name == anchor)
    end = next((pos for pos, name in ids[start + 1 :] if not name.startswith(anchor + ".")), len(page))
    return page[ids[start][0] : end]


@pytest.mark.parametrize(
    ("package", "registry"),
    [("kvscope.policies", POLICIES), ("kvscope.policies.allocation", ALLOCATIONS), ("kvscope.analysis", METRICS)],
)
def test_every_parameter_field_is_listed_with_its_meaning(api_site, package, registry):
    page = (api_site / "index.html").read_text()
    for cls in registry.values():
        section = _section(page, f"{package}.{cls.__name__}")
        for name, (spec, *_rest) in specs(cls).items():
            assert _listed(section, name), (cls.__name__, name)
            assert html.escape(spec.help, quote=False) in section, (cls.__name__, name, spec.help)


def test_trace_settings_fields_are_listed(api_site):
    section = _section((api_site / "index.html").read_text(), "kvscope.TraceSettings")
    from kvscope import TraceSettings

    missing = [f.name for f in dataclasses.fields(TraceSettings) if not _listed(section, f.name)]
    assert not missing
