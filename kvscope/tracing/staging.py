"""Device → host copies of a trace's per-step rows that overlap the decode (docs/trace-format.md#capture).

Each decode step's rows leave the device as the trace stores them
(``kvscope.tracing.decode.BlockBuffers``), into host buffers that hold one block of steps. On CUDA
the buffers are pinned and each copy is queued on a side stream behind the step's work, so that it
overlaps the next step; the host waits for the copies only when the block is handed to the writer
(``HostStaging.wait``). On a CPU the same calls copy at once into ordinary buffers. The buffers
come from a pool that the writer refills once a block is written (``Block.release``): pinned
memory is allocated for the first blocks of a trace, then reused.
"""

from __future__ import annotations

import threading
import time

import torch


class HostStaging:
    """Host buffers and the copies into them for a decode on ``device``."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._free: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype) → buffers not in use
        self._lock = threading.Lock()  # the writer's thread gives buffers back
        self.waited_s = 0.0  # the host's time in ``wait``

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer (pinned for a CUDA device, its contents undefined), from the pool where
        one of that shape and dtype is free."""
        with self._lock:
            free = self._free.get((tuple(shape), dtype))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=self.stream is not None)

    def give_back(self, buffers) -> None:
        """Return ``buffers`` to the pool once nothing reads them any more (any thread)."""
        with self._lock:
            for b in buffers:
                self._free.setdefault((tuple(b.shape), b.dtype), []).append(b)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (a host buffer) ← ``src``: at once on a CPU; on CUDA queued on the side stream
        after the work queued so far, ``src`` kept from reuse until the copy is done."""
        if self.stream is None:
            dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)

    def wait(self) -> None:
        """Every copy queued so far has landed in its buffer."""
        if self.stream is not None:
            t0 = time.perf_counter()
            self.stream.synchronize()
            self.waited_s += time.perf_counter() - t0
