"""``kvscope trace --dask``: the shards of one trace as tasks of a dask.distributed cluster.

    trace_dask(client, prompts, "out.zarr", settings)   one task per worker, then finalize

Task ``i`` runs ``kvscope.tracing.runner.trace`` with ``shard=Shard(i, n)`` — the code path
of ``trace --shard i/n``: it loads the model once and decodes its batches; the first task to
arrive creates the store. Each task is placed on its own worker (``n`` = the cluster's workers;
on ``--resume`` the ``n`` the store was begun with); with ``--device cuda`` a worker that sees
several GPUs decodes on ``cuda:(i mod GPUs)`` (``worker_device``). Every task runs torch with this process's
thread count, so that a cluster's store equals a single-process trace's bit for bit (CPU
kernels' sums depend on the thread count; dask starts its workers with one thread).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from pathlib import Path

from ..errors import KvscopeError
from ..model.loading import resolve
from ..model.prompts import Prompt, as_prompts
from ..storage.paths import output_path
from .runner import (
    TraceResult,
    TraceSettings,
    check_cache,
    check_continuations,
    finalize,
    prepare_out,
    remove_store,
    settings_doc,
    trace,
)
from .shard import Shard


def trace_dask(
    client,
    prompts: list[Prompt] | list[str] | str,
    out: str | Path,
    settings: TraceSettings,
    *,
    resume: bool = False,
    force: bool = False,
    cache=None,
    on_shard: Callable[[TraceResult], None] | None = None,
) -> list[TraceResult]:
    """Trace ``prompts`` into ``out`` with one shard per worker of ``client``; the shards'
    results, in shard order (``on_shard`` is called as each one returns)."""
    import torch
    from distributed import as_completed

    prompts, out = as_prompts(prompts), output_path(out, "--out")
    existing = refuse_early(prompts, out, settings, resume=resume, force=force, cache=cache)
    workers = sorted(client.scheduler_info()["workers"])
    if not workers:
        raise KvscopeError("the dask cluster has no workers")
    n = _shard_count(out, existing, len(workers))
    if force and out.exists():  # before any shard starts
        remove_store(out)
    threads, tag = torch.get_num_threads(), uuid.uuid4().hex[:8]
    futures = {
        client.submit(
            _shard_task, prompts, out, settings, shard=Shard(i, n), resume=resume, cache=cache, threads=threads,
            key=f"kvscope-trace-{tag}-shard-{i}-of-{n}", workers=[workers[i % len(workers)]], allow_other_workers=True,
            pure=False,
        ): i
        for i in range(n)
    }  # fmt: skip
    results: dict[int, TraceResult] = {}
    try:
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            if on_shard is not None:
                on_shard(results[futures[future]])
    except BaseException:
        client.cancel(list(futures))
        raise
    finalize(out)  # the last shard did; a sample not done would be named here
    return [results[i] for i in range(n)]


def refuse_early(prompts, out, settings: TraceSettings, *, resume=False, force=False, cache=None) -> dict | None:
    """What ``trace_dask`` refuses before any worker loads the model (the command line calls
    it before it starts a cluster); the store's attrs when resuming."""
    settings.check()
    check_cache(settings, cache)
    prompts, out = as_prompts(prompts), output_path(out, "--out")
    source = resolve(settings.model)
    check_continuations(settings, prompts, source=source)  # every shard then forces as many steps
    existing = prepare_out(out, settings_doc(settings, source, prompts, cache), resume, force)
    if existing is not None:
        _shard_count(out, existing, 1)
    return existing


def _shard_count(out: Path, existing: dict | None, n_workers: int) -> int:
    """One shard per worker; on ``--resume``, the shards the store was begun with."""
    if existing is None:
        return n_workers
    shards = existing.get("shards")
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise KvscopeError(f"--resume with --dask: {out} was begun by a single process; resume it without --dask")
    return shards


def _shard_task(prompts, out, settings, shard: Shard, resume: bool, cache, threads: int) -> TraceResult:
    """One shard, run inside a worker."""
    import torch

    torch.set_num_threads(threads)
    count = torch.cuda.device_count() if settings.device == "cuda" else 0
    settings = dataclasses.replace(settings, device=worker_device(settings.device, shard, count))
    return trace(prompts, out, settings, resume=resume, shard=shard, cache=cache)


def worker_device(device: str, shard: Shard, n_gpus: int) -> str:
    """The device of ``shard``: ``--device cuda`` on a worker that sees several GPUs (a
    LocalCluster on a multi-GPU machine) spreads the shards, ``cuda:(i mod n_gpus)``; a worker
    that sees one (dask-cuda gives each worker its own) or a device with an index keeps it."""
    return f"cuda:{shard.index % n_gpus}" if device == "cuda" and n_gpus > 1 else device
