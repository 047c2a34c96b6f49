"""``kvscope trace``: decode prompts with attention capture (``--shard``, ``--dask``, ``--finalize``)."""

from __future__ import annotations

import dataclasses

from .. import defaults
from ..errors import KvscopeError
from ..live.inputs import KV_DTYPES
from ..model.loading import DEFAULT_MODEL, MODEL_DTYPES
from ..tracing.settings import HEAD_MODES, KERNELS
from .common import (
    DaskContext,
    add_prompt_sources,
    add_protocol,
    allocation_names,
    human_bytes,
    policy_names,
    progress_bar,
    question_agnostic,
    read_prompts,
)


def add_trace(sub) -> None:
    p = sub.add_parser("trace", help="decode prompts with attention capture into a Zarr store")
    add_prompt_sources(p, required=False)  # not with --finalize
    p.add_argument("--model", default=DEFAULT_MODEL, help="short name, HF folder, .gguf file or hub id")
    p.add_argument(
        "--max-new-tokens", type=int, default=None,
        help="required, except with --workload (recipe's), a given continuation (all of it) or --dataset (every "
        "gold answer whole)",
    )  # fmt: skip
    p.add_argument(
        "--continuation", default=None, metavar="FILE",
        help="teacher-force this UTF-8 text as the decode steps instead of the model's tokens (--prompt only; "
        'JSONL: a "continuation" per line): step t emits its token t, min(its tokens, --max-new-tokens) steps, '
        "no stop at EOS; after the question with --question-agnostic; greedy only",
    )  # fmt: skip
    p.add_argument(
        "--continuation-tokens", type=int, default=None, metavar="N",
        help="--workload prose|code: force the N tokens of the text that follow each prompt (as --continuation)",
    )  # fmt: skip
    p.add_argument("--out", default=None, help="store path (*.zarr); required")
    p.add_argument("--heads", default="kv", help=" | ".join(HEAD_MODES) + " (default kv: kv-group rows)")
    p.add_argument("--resolution", default="token", help="token | window")
    p.add_argument("--window", type=int, default=defaults.W, help="window size w, a multiple of 4")
    p.add_argument("--sinks", type=int, default=defaults.N_SINK, dest="n_sink", help="number of sink positions")
    p.add_argument(
        "--obs-window", type=int, default=defaults.OBS_WINDOW, help="prefill rows kept (SnapKV observation window)"
    )
    p.add_argument("--record", action="append", default=[], help="qkv: also store post-RoPE q, k, v")
    p.add_argument("--dtype", default="float16", help="storage dtype: float16 | float32")
    p.add_argument("--model-dtype", default="auto", help=" | ".join(MODEL_DTYPES))
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    p.add_argument("--attn", default="sdpa", help=" | ".join(KERNELS))
    p.add_argument(
        "--attn-output", default="kernel",
        help="kernel: layer outputs from --attn, bit for bit the untraced model (default) | probs: from the "
        "recorded probabilities, one pass over K and V (equal up to float summation order; faster)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--block-steps", type=int, default=defaults.BLOCK_STEPS, help="steps per written block")
    p.add_argument("--ignore-eos", action="store_true", help="decode max-new-tokens even after EOS")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--trust-remote-code", action="store_true")
    add_protocol(
        p, "prefill the context only, then decode the question into the cache (split prompts: niah, vt, JSONL)"
    )
    p.add_argument(
        "--policy", default=None,
        help="decode under this live policy cache (e.g. qevict, press:SnapKVPress): " + policy_names(live=True),
    )  # fmt: skip
    p.add_argument("--budget", type=float, default=None, help="the budget β of --policy, in (0, 1]")
    p.add_argument(
        "--allocation", default=None, help=f"--policy: how β is split across layers and KV heads: {allocation_names()}"
    )
    p.add_argument(
        "--kv-dtype", default="model", help="--policy: storage of FP entries: " + " | ".join(("model", *KV_DTYPES))
    )
    p.add_argument("--resume", action="store_true", help="continue a partial store (--shard: the shard's samples)")
    p.add_argument("--force", action="store_true", help="overwrite an existing store")
    p.add_argument(
        "--shard", default=None, metavar="I/N",
        help="decode shard I of N (the batches b with b mod N = I) into a store N shards write together",
    )  # fmt: skip
    p.add_argument("--dask", default=None, help="local:N (LocalCluster) or tcp://host:port: one shard per worker")
    p.add_argument("--finalize", default=None, metavar="STORE", help="mark a store whose shards all finished complete")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_trace)


def _trace_cache(args):
    """The live policy cache factory of ``--policy``/``--budget``/``--allocation``/``--kv-dtype``
    (None without)."""
    if args.policy is None and args.budget is None:
        if args.allocation is not None:
            raise KvscopeError("--allocation goes with --policy and --budget")
        return None
    if args.policy is None:
        raise KvscopeError("--budget goes with --policy")
    if args.budget is None:
        raise KvscopeError("--policy needs --budget")
    from ..live import LivePolicy

    return LivePolicy(args.policy, args.budget, args.kv_dtype, args.allocation or "uniform")


def _check_record(args) -> None:
    for item in args.record:
        if item != "qkv":
            raise KvscopeError(f"--record accepts qkv only (got {item!r})")


def _trace_settings(args):
    """``TraceSettings`` from the options of ``kvscope trace`` (the same names, but for two)."""
    from ..tracing.settings import TraceSettings

    renamed = {"record_qkv": "qkv" in args.record, "stop_at_eos": not args.ignore_eos}
    same = {f.name: getattr(args, f.name) for f in dataclasses.fields(TraceSettings) if f.name not in renamed}
    return TraceSettings(**same, **renamed)


def cmd_trace(args) -> int:
    if args.finalize is not None:
        return _finalize(args)
    shard = _shard(args)
    if args.prompt is None and args.prompts is None and args.workload is None and args.dataset is None:
        raise KvscopeError("one of the arguments --prompt --prompts --workload --dataset is required")
    if args.out is None:
        raise KvscopeError("the following arguments are required: --out")
    cache = _trace_cache(args)
    _check_record(args)
    prompts, workload = read_prompts(args)  # a workload's recipe sets --max-new-tokens and --chat
    question_agnostic(args)
    settings = _trace_settings(args)
    settings.check()  # before torch and transformers load: a refused option costs no import
    if args.dask is not None:
        return _trace_dask(args, prompts, workload=workload, settings=settings, cache=cache)
    from ..tracing.runner import trace

    what = "steps · {task.fields[tps]:.1f} tok/s · {task.fields[written]} written"
    bar, task = progress_bar("trace", args.quiet, what, {"tps": 0.0, "written": "0 B"})
    with bar:

        def on_step(p):
            written = human_bytes(p.bytes_written)
            bar.update(task, completed=p.steps_done, total=p.steps_total, tps=p.tokens_per_s, written=written)

        result = trace(
            prompts, args.out, settings, resume=args.resume, force=args.force, progress=on_step, cache=cache,
            shard=shard,
        )  # fmt: skip
    label = f"shard {shard.label}: " if shard is not None else ""
    _print_traced([result], result.seconds, label=label, prompts=prompts, workload=workload)
    return 0


def _shard(args):
    """The ``--shard I/N`` of the command line (None without), checked before any work."""
    if args.shard is None:
        return None
    from ..tracing.shard import Shard

    if args.dask is not None:
        raise KvscopeError("--shard and --dask do not go together: --dask runs one shard per worker itself")
    return Shard.parse(args.shard)


def _trace_dask(args, prompts, *, workload, settings, cache) -> int:
    """``trace --dask``: one shard per worker, then the store is complete."""
    import time

    from ..tracing.distributed import refuse_early, trace_dask

    started = time.perf_counter()
    refuse_early(prompts, args.out, settings, resume=args.resume, force=args.force, cache=cache)  # before the cluster
    with DaskContext(args.dask) as client:
        bar, task = progress_bar("trace", args.quiet, "shards")
        with bar:
            results = trace_dask(
                client, prompts, args.out, settings, resume=args.resume, force=args.force, cache=cache,
                on_shard=lambda r: bar.advance(task),
            )  # fmt: skip
    label = f"{len(results)} shards on {args.dask}: "
    _print_traced(results, time.perf_counter() - started, label=label, prompts=prompts, workload=workload)
    return 0


def _print_traced(results, seconds: float, *, label: str, prompts, workload) -> None:
    """What a trace (or its shards) decoded: steps, speed, the store, each sample's text."""
    from ..storage.store import store_info

    path = results[0].path
    info = store_info(path)
    rows = sorted((s, n, text) for r in results for s, n, text in zip(r.samples, r.steps, r.texts))
    steps = sum(n for _, n, _ in rows)
    state = "" if info["status"] == "complete" else ", the store is partial until every shard is done"
    print(
        f"traced {label}{len(rows)} sample(s), {steps} steps in {seconds:.1f} s "
        f"({steps / seconds if seconds else 0:.1f} steps/s) → {path} "
        f"[{human_bytes(info['stored_bytes'])} on disk, compression {info['compression_ratio'] or 0:.2f}×{state}]"
    )
    for n, _, text in rows:
        graded = ""
        if workload is not None and workload.scorer is not None:
            graded = f" score {workload.scorer(text, prompts[n].expected):.2f} (expected {prompts[n].expected})"
        forced = " (given continuation)" if prompts[n].continuation is not None else ""
        forced = " (gold answer)" if prompts[n].answers is not None else forced
        print(f"  sample {n}{forced}: {text[:120]!r}{graded}")


def _finalize(args) -> int:
    """``trace --finalize STORE``: mark a store whose samples are all done complete."""
    from ..tracing.runner import finalize

    inputs = ("prompt", "prompts", "workload", "dataset", "out", "shard", "dask", "continuation", "continuation_tokens")
    given = [f for f in inputs if getattr(args, f) is not None]
    given += [f for f in ("resume", "force") if getattr(args, f)]
    if given:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise KvscopeError(f"--finalize STORE takes no other trace options (got {flags})")
    done = finalize(args.finalize)
    print(f"{args.finalize} {'is now complete' if done else 'was complete already'}")
    return 0
