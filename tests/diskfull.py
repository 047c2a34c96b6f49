"""A disk that fills up, for machines where the tests cannot mount a small tmpfs (not root).

    python -m tests.diskfull FILES ROOT ARGS…

runs ``kvscope ARGS`` with room for FILES more files under the folder ROOT: every file zarr
writes there after those (each chunk and each ``zarr.json`` of a store goes through
``zarr.storage._local._put``, which writes it to a temporary file and renames it into place)
fails with ENOSPC, as the kernel's write does on a full disk. kvscope's own code is not touched:
the fault is injected below it, where a full disk would raise it. Used by
tests/test_refusals.py's ``small_disk`` fixture only where no tmpfs can be mounted.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path


def fill_after(files: int, root: Path) -> None:
    """zarr's file writes under ``root`` fail with ENOSPC once ``files`` of them succeeded."""
    import zarr.storage._local as local

    put, left = local._put, [files]

    def _put(path, value, *args, **kwargs):
        if Path(path).absolute().is_relative_to(root):
            if left[0] <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            left[0] -= 1
        return put(path, value, *args, **kwargs)

    local._put = _put


if __name__ == "__main__":
    fill_after(int(sys.argv[1]), Path(sys.argv[2]).absolute())
    from kvscope.cli import main

    raise SystemExit(main(sys.argv[3:]))
