"""Output locations, checked before any work starts and before anything is created.

    output_path(path, "--out", inputs=[store])     a store or file kvscope will create
    figure_path(path, "--plot")                    … whose suffix matplotlib can write

An output may not lie below a file or in a folder kvscope cannot write (the first existing
folder above it must be writable), may not be an existing folder where a file is meant, and
is never one of the command's inputs or inside or around one.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import KvscopeError


def output_path(path, flag: str, inputs=()) -> Path:
    """``path`` as an output of ``flag``, refused with one line when it cannot be one."""
    p = Path(path)
    here = p.absolute()
    for parent in here.parents:
        if parent.exists():
            if not parent.is_dir():
                raise KvscopeError(f"{flag} {p}: {parent} is a file, not a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise KvscopeError(f"{flag} {p}: cannot write in {parent}")
            break
    for source in inputs:
        s = Path(source).absolute().resolve()
        target = here.resolve()
        if target == s or s in target.parents or target in s.parents:
            raise KvscopeError(f"{flag} {p} overlaps the input store {source}; choose another path")
    return p


def figure_path(path, flag: str = "--plot") -> Path:
    """A figure file: :func:`output_path`, not a folder, with a format matplotlib writes."""
    p = output_path(path, flag)
    if p.is_dir():
        raise KvscopeError(f"{flag} {p} is a folder; name a file such as figure.png")
    formats = figure_formats()
    suffix = p.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise KvscopeError(
            f"{flag} {p}: unknown figure format {suffix or '(none)'!r} (use {', '.join(sorted(formats))})"
        )
    return p


def figure_formats() -> set[str]:
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())
