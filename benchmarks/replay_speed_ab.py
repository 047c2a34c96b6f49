"""Replay speed, two versions of kvscope side by side: the grid of ``replay_speed.py`` replayed
by the code at ``--before`` and at ``--after`` (two checkouts), alternated round by round
against a plain decode timed in this process, so that both see the same machine load.

Records the benchmark's trace (default model, 1,024-token prose prompt + 128 new tokens, with
q/k/v) at ``--trace`` unless it exists; each replay runs in a fresh process (``REPLAY`` of
``replay_speed.py``: one small warm-up replay, then the grid) and prints per round

    decode_s   one plain decode (prefill + steps), after one warm-up decode
    before     [seconds, peak RSS MiB] of the grid replayed by --before
    after      the same by --after

and the medians, with replay / one decode for each and after / before.

    python benchmarks/replay_speed_ab.py --before /path/to/old/checkout [--after .] [--rounds 3] [--no-record]

Each run is appended to ``benchmarks/results/replay_speed_ab.jsonl`` with both checkouts' commits
(``--no-record``: not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import record  # benchmarks/record.py: runs as data


def commit(checkout: str) -> str:
    """The short commit of a checkout (``+`` where its tracked files differ from it), or ``""``."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", checkout, *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + (
            "+" if git("status", "--porcelain", "--untracked-files=no") else ""
        )
    except (OSError, subprocess.CalledProcessError):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="checkout whose kvscope replays first")
    ap.add_argument("--after", default=str(ROOT), help="checkout whose kvscope replays second (default: this one)")
    ap.add_argument("--trace", default="/tmp/kvscope-replay-ab/trace.zarr")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budgets", default="0.2,0.35,0.5")
    record.add_argument(ap)
    args = ap.parse_args()
    machine_info = record.machine()  # the load as the run begins

    import replay_speed as rs
    from trace_overhead import prose_prompt, untraced_decode

    from kvscope.cli import quiet_libraries
    from kvscope.model.loading import load, resolve
    from kvscope.model.prompts import Prompt
    from kvscope.tracing.runner import TraceSettings, trace_loaded

    quiet_libraries().__enter__()
    source = resolve("smollm2-135m")
    model, tokenizer = load(source, "cpu")
    prompt = prose_prompt(tokenizer, 1024)
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    if not Path(args.trace).exists():
        settings = TraceSettings(model="smollm2-135m", max_new_tokens=128, stop_at_eos=False, record_qkv=True)
        trace_loaded(model, tokenizer, source, [Prompt(prompt, "pydoc_data")], out=args.trace, settings=settings)

    def decode() -> float:
        model.set_attn_implementation("sdpa")
        prefill_s, decode_s, _ = untraced_decode(model, input_ids, 128, lambda: None)
        return prefill_s + decode_s

    def replay(root: str) -> tuple[float, float]:
        proc = subprocess.run(
            [sys.executable, "-c", rs.REPLAY, args.trace, ",".join(rs.POLICIES), args.budgets, "renorm"],
            capture_output=True, text=True, check=True, cwd=root, env=dict(os.environ, PYTHONPATH=root),
        )  # fmt: skip
        out = json.loads(proc.stdout)
        return out["seconds"], out["rss_kib"] / 1024

    decode()  # warm-up
    rounds = []
    for _ in range(args.rounds):
        rounds.append({"decode_s": decode(), "before": replay(args.before), "after": replay(args.after)})
        rounds[-1]["load"] = round(os.getloadavg()[0], 2)  # the load average at the end of the round
        print(json.dumps(rounds[-1]), flush=True)
    one = statistics.median(r["decode_s"] for r in rounds)
    before = statistics.median(r["before"][0] for r in rounds)
    after = statistics.median(r["after"][0] for r in rounds)
    medians = {
        "decode_median": one, "before_median": before, "after_median": after, "before_over_decode": before / one,
        "after_over_decode": after / one, "after_over_before": after / before,
    }  # fmt: skip
    print(json.dumps(medians))
    figures = {
        "before": args.before, "before_commit": commit(args.before), "after": args.after,
        "after_commit": commit(args.after), "budgets": args.budgets, "rounds": rounds, **medians,
    }  # fmt: skip
    record.finish("replay_speed_ab", args, figures, machine_info)


if __name__ == "__main__":
    main()
