"""Both notebooks run top to bottom on a small real trace (nbclient, a real kernel), and are
committed without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

import kvscope

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["explore_attention_drift.ipynb", "compare_policies.ipynb"]


@pytest.fixture(scope="module")
def small_qkv_trace(tmp_path_factory, smollm2_dir):
    import pydoc_data.topics as topics

    out = tmp_path_factory.mktemp("notebooks") / "small-qkv.zarr"
    kvscope.trace(topics.topics["assignment"][:1000], out, max_new_tokens=40, stop_at_eos=False, record_qkv=True)
    return out


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch, small_qkv_trace, name):
    from nbclient import NotebookClient

    monkeypatch.setenv("KVSCOPE_TRACE", str(small_qkv_trace))
    monkeypatch.setenv("KVSCOPE_QKV_TRACE", str(small_qkv_trace))
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    figures = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(figures) >= 3
    if name == "explore_attention_drift.ipynb":  # kvscope.view(ds): the explorer as a Panel/Bokeh app in the page
        shown = [o for o in nb.cells[-1].outputs if o.output_type == "execute_result"]
        assert shown and "application/vnd.holoviews_exec.v0+json" in shown[0]["data"]
        assert "\"heatmap\"" in shown[0]["data"]["text/html"]  # the heatmap figure, named, in the embedded document
