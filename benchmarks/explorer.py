"""The explorer's speed and memory, in a real headless Chromium against ``kvscope view``.

Synthetic token-resolution stores with SmolLM2-135M's geometry (30 layers × 3 KV heads,
random rows, ``write_synthetic_store``) of 1,024 / 4,096 / 16,384 positions × 128 steps. For
each, a ``kvscope view`` server is started (its own process) and one page opened:

* first view: page navigation → the heatmap's image drawn (server already up), and the
  server's start (process start → URL printed);
* interactions (after the side views are computed), each from the real mouse or widget
  action to the new image in the page: a layer switch (median of ``--repeat``), wheel zooms
  at the centre until the view shows exact rows (median over them), drags in exact rows
  (median of ``--repeat``);
* the server's peak RSS (``/proc/PID/status`` VmHWM) once the side views are computed (one
  streaming pass over the trace) and after the interactions: what the interactions add is
  bounded by the chunks in view (one block of steps × one layer × all positions per chunk).

    python benchmarks/explorer.py [--positions 1024,4096,16384] [--repeat 5] [--no-record]

Each run is appended to ``benchmarks/results/explorer.jsonl`` (``--no-record``: not).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # benchmarks/record.py: runs as data

from kvscope.storage.synthetic import write_synthetic_store

STEPS, LAYERS, KV = 128, 30, 3
CHANGED = """([name, before]) => { const m = Bokeh.documents[0].get_model_by_name(name);
  return m.data.image.length > 0 && m.data.image[0] !== before; }"""


def memory(pid: int, key: str = "VmHWM") -> int:
    """Bytes of ``/proc/PID/status``'s VmHWM (peak RSS) or VmRSS."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def timed(page, action) -> float:
    """Seconds from ``action`` to a new heatmap image in the page."""
    page.evaluate("() => { window.__img = Bokeh.documents[0].get_model_by_name('heatmap-heat').data.image[0]; }")
    t = time.perf_counter()
    action()
    page.wait_for_function(
        "() => Bokeh.documents[0].get_model_by_name('heatmap-heat').data.image[0] !== window.__img", timeout=60_000
    )
    return time.perf_counter() - t


def center(page) -> tuple[float, float]:
    return page.evaluate(
        """() => { const v = Bokeh.index.find_one(Bokeh.documents[0].get_model_by_name('heatmap'));
           const r = v.canvas_view.el.getBoundingClientRect(), f = v.frame.bbox;
           return [r.left + f.left + f.width / 2, r.top + f.top + f.height / 2]; }"""
    )


def wheel(page, clicks: int) -> None:
    """A real mouse-wheel zoom at the heatmap's centre (negative: in)."""
    page.mouse.move(*center(page))
    page.mouse.wheel(0, 100 * clicks)


def drag(page, dx: float) -> None:
    """A real pan: drag the heatmap by ``dx`` pixels."""
    x, y = center(page)
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + dx, y, steps=4)
    page.mouse.up()


def title(page) -> str:
    return page.evaluate("() => Bokeh.documents[0].get_model_by_name('heatmap').title.text")


def measure(browser, store: Path, n_pos: int, repeat: int) -> dict:
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "view", str(store), "--tokens", "ids"], stdout=subprocess.PIPE, text=True
    )
    url = proc.stdout.readline().split()[2]
    started = time.perf_counter() - t
    try:
        page = browser.new_page(viewport={"width": 1500, "height": 1200})
        t = time.perf_counter()
        page.goto(url)
        page.wait_for_function(
            "() => window.Bokeh && Bokeh.documents.length && Bokeh.documents[0].get_model_by_name('heatmap-heat')"
            " && Bokeh.documents[0].get_model_by_name('heatmap-heat').data.image[0].length > 1",
            timeout=120_000,
        )
        first = time.perf_counter() - t
        page.wait_for_function(
            "() => Bokeh.documents[0].get_model_by_name('status').text.includes('FMM')", timeout=600_000
        )
        ready = memory(proc.pid)
        layer = [
            timed(page, lambda i=i: page.locator(".kv-layer select").select_option(str(1 + i % 8)))
            for i in range(repeat)
        ]
        zooms = []
        while "exact rows" not in title(page):
            zooms.append(timed(page, lambda: wheel(page, -3)))
        pans = [timed(page, lambda i=i: drag(page, 60 if i % 2 else -60)) for i in range(repeat)]
        page.close()
        return {
            "positions": n_pos,
            "server_start_s": started,
            "first_view_s": first,
            "layer_ms": 1000 * statistics.median(layer),
            "zoom_ms": 1000 * statistics.median(zooms),
            "zooms": len(zooms),
            "pan_exact_ms": 1000 * statistics.median(pans),
            "ready_peak_mib": ready / 2**20,
            "server_peak_mib": memory(proc.pid) / 2**20,
        }
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--positions", default="1024,4096,16384")
    ap.add_argument("--repeat", type=int, default=5)
    record.add_argument(ap)
    args = ap.parse_args()
    machine_info = record.machine()  # the load as the run begins
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        for n_pos in (int(x) for x in args.positions.split(",")):
            store = write_synthetic_store(
                Path(tmp) / f"t{n_pos}.zarr", n_samples=1, n_steps=STEPS, n_layers=LAYERS, n_kv=KV,
                prompt_len=n_pos - STEPS + 1, block_steps=32,
            )  # fmt: skip
            rows.append(measure(browser, store, n_pos, args.repeat))
            print(rows[-1], flush=True)
        browser.close()
    figures = {"steps": STEPS, "layers": LAYERS, "kv_heads": KV, "repeat": args.repeat, "rows": rows}
    record.finish("explorer", args, figures, machine_info)
    print(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {STEPS} steps, {LAYERS} layers × {KV} KV heads\n"
    )
    print(
        "| positions | server start | first view | layer switch | wheel zoom | pan (exact rows) "
        "| server peak RSS: side views computed | after the interactions |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['positions']:,} | {r['server_start_s']:.1f} s | {r['first_view_s']:.2f} s | {r['layer_ms']:.0f} ms "
            f"| {r['zoom_ms']:.0f} ms ({r['zooms']}) | {r['pan_exact_ms']:.0f} ms | {r['ready_peak_mib']:.0f} MiB "
            f"| {r['server_peak_mib']:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
