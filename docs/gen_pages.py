"""Pages generated when the site is built (mkdocs-gen-files runs this; nothing is written to docs/).

* ``benchmarks.md`` and its figures: every run recorded in ``benchmarks/results/*.jsonl``
  (``benchmarks/history.py``).
* ``performance.md``: docs/performance.md with each ``<!-- today: NAME -->`` replaced by the table
  of benchmark NAME's figures today, from the same records (``history.fill_today``).
* ``notebooks/*.ipynb``: the project's notebooks executed top to bottom on a small real trace of
  the default model (three prompts, traced here unless ``KVSCOPE_TRACE`` names one recorded with
  q/k/v), so the site shows their tables and figures; mkdocs-jupyter renders them.
  ``KVSCOPE_DOCS_EXECUTE=0`` renders them unexecuted (a quick local preview).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["explore_attention_drift.ipynb", "compare_policies.ipynb"]


def benchmark_history() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import history  # benchmarks/history.py

    runs = history.load_runs(ROOT / "benchmarks" / "results")
    with mkdocs_gen_files.open("benchmarks.md", "w") as page:
        page.write(history.page(runs))
    performance = (ROOT / "docs" / "performance.md").read_text()
    with mkdocs_gen_files.open("performance.md", "w") as page:
        page.write(history.fill_today(performance, runs))
    with tempfile.TemporaryDirectory() as tmp:
        for name, records in runs.items():
            figure = Path(tmp) / f"{name}.png"
            history.plot(name, records, figure)
            if figure.exists():
                with mkdocs_gen_files.open(f"benchmarks/{name}.png", "wb") as out:
                    out.write(figure.read_bytes())


def small_trace(folder: Path) -> Path:
    """Three prose prompts of the default model (~250 tokens each), 120 steps, q/k/v recorded:
    intervals over prompts, and events enough for every metric (an LIR episode needs 4 + 8 events
    after a window is selected)."""
    import pydoc_data.topics as topics

    import kvscope

    out = folder / "docs-qkv.zarr"
    texts = [topics.topics[name][:1000] for name in ("assignment", "if", "while")]
    kvscope.trace(texts, out, max_new_tokens=120, stop_at_eos=False, record_qkv=True)
    return out


def notebooks() -> None:
    import nbformat

    execute = os.environ.get("KVSCOPE_DOCS_EXECUTE", "1") != "0"
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(os.environ["KVSCOPE_TRACE"]) if "KVSCOPE_TRACE" in os.environ else None
        if execute and trace is None:
            trace = small_trace(Path(tmp))
        for name in NOTEBOOKS:
            nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
            if execute:
                from nbclient import NotebookClient

                os.environ["KVSCOPE_TRACE"] = os.environ["KVSCOPE_QKV_TRACE"] = str(trace)
                NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": tmp}}).execute()
            with mkdocs_gen_files.open(f"notebooks/{name}", "w") as out:
                nbformat.write(nb, out)


benchmark_history()
notebooks()
