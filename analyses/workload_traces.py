"""The traces every study reads: each built-in workload on the default model, recorded once
(with q/k/v, so replay can measure attention errors) into ``results/traces/NAME.zarr``.

    python analyses/workload_traces.py [--context 1024] [--workloads prose,code,niah,vt_chains,reasoning]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOADS = ["prose", "code", "niah", "vt_chains", "reasoning"]
RESULTS = ROOT / "results"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per sample")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default=str(RESULTS), help="results folder")


def ensure_traces(args) -> dict[str, Path]:
    """``{workload: store}``, tracing the ones that are missing or were made differently."""
    import kvscope
    from kvscope import workloads

    out = Path(args.results) / "traces"
    out.mkdir(parents=True, exist_ok=True)
    stores = {}
    for name in args.workloads.split(","):
        recipe = workloads.get(name).recipe
        path = out / f"{name}-{args.context}.zarr"
        stamp = {"workload": name, "context": args.context, "seed": args.seed, "model": args.model}
        marker = path.with_suffix(".json")
        if path.exists() and marker.exists() and json.loads(marker.read_text()) == stamp:
            stores[name] = path
            continue
        prompts = workloads.prompts_for_model(
            name, args.model, context=args.context, seed=args.seed, max_new_tokens=recipe["max_new_tokens"]
        )
        t0 = time.perf_counter()
        kvscope.trace(
            prompts,
            path,
            model=args.model,
            max_new_tokens=recipe["max_new_tokens"],
            chat=bool(recipe.get("chat", False)),
            record_qkv=True,
            seed=args.seed,
            force=True,
        )
        marker.write_text(json.dumps(stamp))
        print(f"traced {name}: {len(prompts)} samples in {time.perf_counter() - t0:.0f} s → {path}", file=sys.stderr)
        stores[name] = path
    return stores


def task_scores(path: Path) -> list[float | None]:
    """The workload scorer's grade of each sample's full-KV generation."""
    import kvscope
    from kvscope import workloads
    from kvscope.model.loading import load_tokenizer, resolve

    ds = kvscope.open_trace(path)
    prompts = ds.attrs["prompts"]
    name = prompts[0]["meta"]["workload"]
    if workloads.get(name).scorer is None:
        return [None] * len(prompts)
    model = resolve(ds.attrs["settings"]["model"], allow_hub=False)  # a store's model is never fetched
    tokenizer = load_tokenizer(model)
    scores = []
    for s, prompt in enumerate(prompts):
        text = tokenizer.decode(ds.kvscope.generated(s).tolist(), skip_special_tokens=True)
        scores.append(workloads.score(name, text, prompt["expected"]))
    return scores


def write_summary(folder: Path, title: str, doc: dict, markdown: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(doc, indent=1))
    (folder / "summary.md").write_text(f"# {title}\n\n" + "\n".join(markdown) + "\n")
    print(f"wrote {folder / 'summary.md'}", file=sys.stderr)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    for name, path in ensure_traces(ap.parse_args()).items():
        print(name, path)
