"""One sample's inputs for replay, read lazily block by block (the memory bound: one stored
block of rows, and the sample's K/V where errors or exact observation need them)."""

from __future__ import annotations

import numpy as np
import xarray as xr

from ..analysis.kernels import refuse_bad_rows, row_checks, row_totals
from ..storage.dtypes import cast


def unit_span(ds: xr.Dataset) -> tuple[int, int]:
    """``(first, count)``: the model's cache units (KV heads) a trace — or a replay task's part of
    it — holds."""
    model = ds.kvscope.model
    if "kv_head" in ds.coords:
        values = ds["kv_head"].values
        return (int(values[0]), len(values)) if len(values) else (0, 0)
    values = ds["head"].values if "head" in ds.coords else np.arange(model.n_heads)
    return int(values[0]) // model.group, max(1, len(values) // model.group)


def rule_of(ds: xr.Dataset, layer: int):
    """The attention rule of stored layer ``layer`` for the cache units ``ds`` holds (the learned
    sinks of their query heads)."""
    model = ds.kvscope.model
    first, count = unit_span(ds)
    return model.rule(layer).of_kv_heads(first, count, model.n_kv_heads)


def answered(ds: xr.Dataset) -> np.ndarray:
    """``[sample]`` bool: the samples whose prompt carries accepted answers (``Prompt.answers`` in the
    trace's ``prompts`` attribute: ``trace --dataset``). Such a trace forced the gold answer's tokens
    as the sample's decode steps after any question (``kvscope.model.prompts.answer_ids``), so its
    scored forced steps are exactly the answer's."""
    from ..model.prompts import has_answers

    prompts = ds.attrs.get("prompts") or []
    n = ds.sizes["sample"]
    return np.array([s < len(prompts) and has_answers(prompts[s]) for s in range(n)], dtype=bool)


class SampleReader:
    """Rows, queries, prompt attention and K/V of sample ``s`` of a trace whose stored rows
    come ``group`` per KV head."""

    def __init__(self, ds: xr.Dataset, s: int, group: int):
        acc = ds.kvscope
        self.ds, self.s = ds, s
        self.block, self.group = acc.block_steps, group
        self.prompt_len = int(acc.prompt_len[s])
        self.n_steps = int(acc.n_steps[s])
        self.final_len = self.prompt_len + self.n_steps
        self.query_pos = acc.query_pos[s]  # [step]
        self.recomputed = acc.resolution != "token"  # window sums stored: rows recomputed from q/k
        self.slack = acc.rows.slack  # the rows' relative error (a lossy row format; 0: exact)
        self.learned_sinks = "attn_learned_sink" in ds  # rows sum to 1 − σ, σ stored beside them
        self._rows: dict[int, np.ndarray] = {}
        self._shares: dict[int, np.ndarray] = {}
        self._queries: dict[int, np.ndarray] = {}
        self._kv: tuple[np.ndarray, np.ndarray] | None = None

    def _kv_groups(self, x: np.ndarray, axis: int) -> np.ndarray:
        """Rows of the query heads of a KV group averaged (``--heads all`` stores)."""
        if self.group == 1:
            return x
        shape = x.shape[:axis] + (x.shape[axis] // self.group, self.group) + x.shape[axis + 1 :]
        return x.reshape(shape).mean(axis + 1)

    def _block_of(self, t: int) -> tuple[int, slice]:
        b = t // self.block
        return b, slice(b * self.block, min((b + 1) * self.block, self.n_steps))

    def row(self, t: int) -> np.ndarray:
        """Full-KV kv-group row of step ``t``: ``[layer, kv_head, final_len]`` float32 (0 beyond)."""
        b, steps = self._block_of(t)
        if b not in self._rows:
            for old in [k for k in self._rows if k < b - 1]:  # the oracle's look-ahead reads one block ahead
                del self._rows[old]
                self._shares.pop(old, None)
            a = (
                self._recompute(steps)
                if self.recomputed
                else self.ds["attn"].isel(sample=self.s, step=steps, pos=slice(0, self.final_len)).values
            )
            shares = self._read_shares(steps)  # [step, L, Hs] or None
            totals = row_totals(None if shares is None else shares.reshape(shares.shape[0], -1))
            where = f"attn rows of sample {self.s}, steps {steps.start}–{steps.stop - 1}"
            refuse_bad_rows(
                row_checks(a.reshape(a.shape[0], -1, a.shape[-1]), self.query_pos[steps], self.slack, totals), where
            )
            a = cast(a, np.float32)
            np.copyto(a, 0, where=np.isnan(a))  # the positions beyond each query (checked: no inf)
            self._rows[b] = self._kv_groups(a, 2)  # [step, L, Hkv, pos]
            if shares is not None:
                self._shares[b] = self._kv_groups(np.nan_to_num(shares), 2)  # [step, L, Hkv]
        return self._rows[b][t - steps.start]

    def _read_shares(self, steps: slice) -> np.ndarray | None:
        """The learned sink's share ``σ`` of the stored rows of ``steps`` ``[step, layer, Hs]``
        float32, or None (no learned sinks)."""
        if not self.learned_sinks:
            return None
        return np.asarray(self.ds["attn_learned_sink"].isel(sample=self.s, step=steps).values, dtype=np.float32)

    def share(self, t: int) -> np.ndarray | None:
        """The learned sink's share of step ``t``'s kv-group row ``[layer, kv_head]`` (the row sums
        to ``1 − σ``), or None without learned sinks."""
        if not self.learned_sinks:
            return None
        self.row(t)
        b, steps = self._block_of(t)
        return self._shares[b][t - steps.start]

    def _recompute(self, steps: slice) -> np.ndarray:
        """Rows ``[step, layer, stored head, final_len]`` of ``steps`` from the recorded q and k,
        by the model's attention rule of each layer (``kvscope.analysis.recompute.layer_rows``)."""
        from ..analysis.recompute import layer_rows

        qpos = self.query_pos[steps]
        q = self._query_block(steps)  # [n, layer, head, D]
        k = self.kv()[0]  # [layer, kv_head, final_len, D]
        model, heads = self.ds.kvscope.model, "all" if self.group > 1 else "kv"
        rows = [
            layer_rows(q[:, i], k[i], qpos, rule_of(self.ds, model.stored_layer(int(layer))), heads=heads,
                       q_first=int(qpos[0]), per_unit=model.n_key_heads // model.n_kv_heads)[0, :, 0]
            for i, layer in enumerate(self.ds["layer"].values)
        ]  # fmt: skip
        return np.stack(rows, axis=1)

    def query(self, t: int) -> np.ndarray:
        """Recorded query of step ``t``: ``[layer, head, D]`` float32."""
        _, steps = self._block_of(t)
        return self._query_block(steps)[t - steps.start]

    def _query_block(self, steps: slice) -> np.ndarray:
        """Recorded queries of a block of steps ``[step, layer, head, D]`` float32, read once for
        the errors and the recomputed rows (this block and the one before are kept, as rows are)."""
        b = steps.start // self.block
        if b not in self._queries:
            for old in [k for k in self._queries if k < b - 1]:
                del self._queries[old]
            qpos = self.query_pos[steps]
            q = self.ds["q"].isel(sample=self.s, qpos=slice(int(qpos[0]), int(qpos[-1]) + 1)).values
            self._queries[b] = cast(q, np.float32, copy=False)
        return self._queries[b]

    def prefill(self) -> tuple[np.ndarray, np.ndarray]:
        """``colsum [layer, kv_head, P]`` float64 and ``tail [layer, kv_head, obs, P]`` float32."""
        p = self.prompt_len
        colsum = self.ds["prefill_colsum"].isel(sample=self.s, pos=slice(0, p)).values
        tail = self.ds["prefill_tail"].isel(sample=self.s, pos=slice(0, p)).values
        return (
            self._kv_groups(np.nan_to_num(colsum.astype(np.float64)), 1),
            self._kv_groups(np.nan_to_num(cast(tail, np.float32), copy=False), 1),
        )

    def queries(self) -> np.ndarray:
        """Recorded queries of every position ``[final_len, layer, head, D]`` float32 (post-RoPE)."""
        return cast(self.ds["q"].isel(sample=self.s, qpos=slice(0, self.final_len)).values, np.float32)

    def kv(self) -> tuple[np.ndarray, np.ndarray]:
        """Recorded ``k, v [layer, kv_head, final_len, D]`` in the stored dtype (read once)."""
        if self._kv is None:
            k = self.ds["k"].isel(sample=self.s, pos=slice(0, self.final_len)).values
            v = self.ds["v"].isel(sample=self.s, pos=slice(0, self.final_len)).values
            self._kv = np.ascontiguousarray(k), np.ascontiguousarray(v)
        return self._kv

    def future(self, h: int) -> FutureSum:
        return FutureSum(self, h)


class FutureSum:
    """Full-KV attention over the next ``h`` steps per position — only the oracle may ask:
    ``at(t) = Σ_{t'=t+1}^{min(t+h, S−1)} row[t']``, kept as a sliding sum."""

    def __init__(self, reader: SampleReader, h: int):
        self.reader, self.h, self.t = reader, h, -1
        self.total: np.ndarray | None = None

    def at(self, t: int) -> np.ndarray:
        n = self.reader.n_steps
        if t == self.t:
            return self.total
        if self.total is None or t != self.t + 1:
            self.total = np.zeros(self.reader.row(0).shape, dtype=np.float64)
            for tt in range(t + 1, min(t + self.h, n - 1) + 1):
                self.total += self.reader.row(tt)
        else:  # new arrays, not in place: the runs of step t − 1 may still read the previous sum
            self.total = self.total - self.reader.row(t)
            if t + self.h <= n - 1:
                self.total = self.total + self.reader.row(t + self.h)
        self.t = t
        return self.total
