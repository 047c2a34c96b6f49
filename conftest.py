"""The pages are tests too: every ``sh``, ``bash`` and ``python`` block of README.md and docs/
runs (tests/markdown_examples.py says how, and how a block shows its output)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.markdown_examples import Page, collector, given_store, needs_given_store, page_environment

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `make test` runs the files on pytest-xdist workers, one per core: each worker (and every process
# it starts: CLI runs, notebook kernels, shards, the pages' commands) computes on one thread, not on
# all the machine's (set before torch is imported: its thread pool reads it once)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_collect_file = collector().pytest()


@pytest.fixture(scope="session")
def _docs_given_folder(tmp_path_factory):
    """Where ``prose.zarr`` is traced once for the whole run (shared by the test workers)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if base.name.startswith("popen-gw") else base) / "docs-given"


@pytest.fixture(scope="session")
def _docs_environment():
    """The pages' environment, their ``kvscope`` commands served by this worker's fork server
    (tests/forkserver.py; ``KVSCOPE_TEST_FORKSERVER=0``: each a fresh console script)."""
    from tests import forkserver

    env = page_environment()
    if forkserver.enabled():
        env["PATH"] = f"{forkserver.client().parent}{os.pathsep}{env['PATH']}"
    return env


@pytest.fixture(scope="module")
def _docs_page(request, tmp_path_factory, _docs_given_folder, _docs_environment):
    """One page's working folder (its blocks run there, in order), with ``prose.zarr`` copied in
    when the page reads it without tracing it; numpy's print options as they were afterwards."""
    import numpy as np

    path = request.path
    page = Page(path, tmp_path_factory.mktemp("page-" + path.stem), dict(_docs_environment), given=_docs_given_folder)
    if needs_given_store(path.read_text()):
        store = given_store(_docs_given_folder, page.env)
        shutil.copytree(store, page.folder / store.name)
    printing = np.get_printoptions()
    yield page
    np.set_printoptions(**printing)
