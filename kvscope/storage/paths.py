"""Output locations, checked before any work starts and before anything is created.

    output_path(path, "--out", inputs=[store])     a store kvscope will create (with its missing folders)
    output_path(path, "--html", file=True)         a file kvscope will write, in a folder that exists
    figure_path(path, "--plot")                    … whose suffix matplotlib can write
    no_space(path, what, needs, then)              the line of a write that filled the disk (disk_full)

An output may not lie below a file or in a folder kvscope cannot write (the first existing
folder above a store, the folder of a file: a file is created there and removed to know, as
``os.access`` answers yes to root and in /proc or /sys, where nothing can be created), may not
be an existing folder where a file is meant, and is never one of the command's inputs or inside
or around one.

A disk (or a quota) that fills up while an output is written is one line too: what was being
written where, the space it needs, the space free, and what was kept (``no_space``).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import KvscopeError, StoreError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # the disk is full; the user's quota on it is


def output_path(path, flag: str, inputs=(), file: bool = False) -> Path:
    """``path`` as an output of ``flag`` (a store, or with ``file`` a file), refused with one
    line when it cannot be one."""
    p = Path(path)
    here = p.absolute()
    parent = next(d for d in here.parents if d.exists())
    if not parent.is_dir():
        raise KvscopeError(f"{flag} {p}: {parent} is a file, not a folder")
    if file and parent != here.parent:
        raise KvscopeError(f"{flag} {p}: the folder {here.parent} does not exist")
    for source in inputs:
        s = Path(source).absolute().resolve()
        target = here.resolve()
        if target == s or s in target.parents or target in s.parents:
            raise KvscopeError(f"{flag} {p} overlaps the input store {source}; choose another path")
    if not writable(parent):
        raise KvscopeError(f"{flag} {p}: cannot write in {parent}")
    return p


def writable(folder: Path) -> bool:
    """Whether a file can be created in ``folder``: one is, and removed."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        fd, name = tempfile.mkstemp(prefix=".kvscope-probe-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def figure_path(path, flag: str = "--plot") -> Path:
    """A figure file: ``output_path``, not a folder, with a format matplotlib writes."""
    p = output_path(path, flag, file=True)
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


def disk_full(exc: BaseException) -> bool:
    """``exc`` says that the disk, or the user's quota on it, is full."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def no_space(path, what: str, needs: int | None, then: str) -> StoreError:
    """The one line of a write that filled the disk: ``what`` was being written at ``path``,
    the space it needs (about ``needs`` bytes; None: not known), the space free there now, and
    ``then`` (what was kept, what to do)."""
    free = shutil.disk_usage(_folder_of(path)).free
    needed = f"it needs about {human_bytes(needs)}, " if needs is not None else ""
    return StoreError(f"no space left on device writing {what} {path}: {needed}{human_bytes(free)} free there; {then}")


def block_size(path) -> int:
    """The allocation unit of the file system ``path`` lies on (its first existing folder)."""
    return os.statvfs(_folder_of(path)).f_bsize


def _folder_of(path) -> Path:
    """``path`` if it is a folder, else the first folder above it."""
    here = Path(path).absolute()
    return next(d for d in (here, *here.parents) if d.is_dir())


def human_bytes(n: float) -> str:
    """``n`` bytes in words, in powers of 1024: ``512 B``, ``1.5 KB``, ``3.2 MB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"
