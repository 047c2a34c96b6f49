"""The dask.distributed clusters kvscope starts itself (``--dask local:N``, the benchmarks).

dask's nanny starts each worker with ``MALLOC_TRIM_THRESHOLD_=65536`` (its
``distributed.nanny.pre-spawn-environ``), so that a long-lived worker hands freed memory back
to the OS. Setting any of glibc's malloc thresholds also turns off its *dynamic* mmap
threshold: every allocation above 128 KiB is then a fresh ``mmap`` whose pages fault in on
first touch and go back at ``free``. A replay task allocates and frees arrays of a few hundred
KiB thousands of times a step; in such a worker it ran 1.45× slower than in a plain process
(3.6 million page faults, 3.8 s of system time for one grid; ``docs/replay.md``, "Workers").
The workers kvscope starts leave glibc's defaults alone; workers someone else started can do
the same with ``DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON__MALLOC_TRIM_THRESHOLD_=None`` in
the environment of ``dask worker``.
"""

from __future__ import annotations

WORKER_ENVIRON = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}


def local_cluster(n_workers: int, **kwargs):
    """A ``distributed.LocalCluster`` of ``n_workers`` single-threaded worker processes with
    glibc's default allocator settings (module docstring); ``kwargs`` go to LocalCluster."""
    import dask
    from distributed import LocalCluster

    options = {"threads_per_worker": 1, "dashboard_address": None, "silence_logs": 50, **kwargs}
    with dask.config.set(WORKER_ENVIRON):
        return LocalCluster(n_workers=n_workers, **options)
