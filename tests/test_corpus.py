"""A corpus of named bad inputs, one or more for every subcommand: each is a `kvscope`
command that must end with exit 2 and exactly one stderr line naming the problem, and no
input store may change. Every case runs through the CLI's ``main``; the first of each
subcommand also as a real subprocess. (Damaged stores: tests/test_verify.py; models, prompts,
links and crash safety: tests/test_inputs.py.)"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

import kvscope

from .conftest import run_cli, run_main, tree_digest
from .test_capture import PROMPT

CASES = [
    # -- trace --------------------------------------------------------------------------------
    ("trace-model-missing", ["trace", "--model", "/nonexistent/model", "--prompt", "hi", "--max-new-tokens", "2", "--out", "{TMP}/a.zarr"], "model not found"),
    ("trace-model-unknown-name", ["trace", "--model", "no-such-model", "--prompt", "hi", "--max-new-tokens", "2", "--out", "{TMP}/a.zarr"], "model not found: 'no-such-model'"),
    ("trace-max-new-tokens-0", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "0", "--out", "{TMP}/a.zarr"], "--max-new-tokens must be at least 1"),
    ("trace-heads", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--heads", "some", "--out", "{TMP}/a.zarr"], "--heads must be one of all, kv, mean"),
    ("trace-attn-output", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--attn-output", "fused", "--out", "{TMP}/a.zarr"], "--attn-output must be one of kernel, probs"),
    ("trace-model-dtype", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--model-dtype", "float7", "--out", "{TMP}/a.zarr"], "--model-dtype must be one of auto, float32, bfloat16, float16 (got 'float7')"),
    ("trace-window-6", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--window", "6", "--out", "{TMP}/a.zarr"], "--window must be a positive multiple of 4"),
    ("trace-record-logits", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--record", "logits", "--out", "{TMP}/a.zarr"], "--record accepts qkv only"),
    ("trace-device-tpu", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--device", "tpu", "--out", "{TMP}/a.zarr"], "--device must be cpu or cuda"),
    ("trace-temperature-nan", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--temperature", "nan", "--out", "{TMP}/a.zarr"], "must be a finite number"),
    ("trace-temperature-negative", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--temperature", "-1", "--out", "{TMP}/a.zarr"], "--temperature must be ≥ 0"),
    ("trace-batch-size-0", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--batch-size", "0", "--out", "{TMP}/a.zarr"], "--batch-size must be at least 1"),
    ("trace-out-below-a-file", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--out", "{FILE}/a.zarr"], "is a file, not a folder"),
    ("trace-out-complete-store", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--out", "{QKV}"], "holds a complete trace; pass --force"),
    ("trace-policy-parameter", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--policy", "qevict:q_frac=2", "--budget", "0.3", "--out", "{TMP}/a.zarr"], "qevict parameter q_frac must lie in [0, 1] (got 2.0)"),
    ("trace-budget-alone", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--budget", "0.3", "--out", "{TMP}/a.zarr"], "--budget goes with --policy"),
    ("trace-policy-alone", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--policy", "h2o", "--out", "{TMP}/a.zarr"], "--policy needs --budget"),
    ("trace-policy-oracle", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--policy", "oracle", "--budget", "0.3", "--out", "{TMP}/a.zarr"], "clairvoyant"),
    ("trace-mean-heads-with-qkv", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--heads", "mean", "--record", "qkv", "--out", "{TMP}/a.zarr"], "--heads mean keeps one"),
    ("trace-prompts-file-missing", ["trace", "--model", "{TINY}", "--prompts", "{TMP}/none.jsonl", "--max-new-tokens", "2", "--out", "{TMP}/a.zarr"], "prompts file not found"),
    ("trace-context-without-workload", ["trace", "--model", "{TINY}", "--prompt", "hi", "--context", "64", "--max-new-tokens", "2", "--out", "{TMP}/a.zarr"], "--context and --samples go with --workload"),
    ("trace-workload-unknown", ["trace", "--workload", "poetry", "--out", "{TMP}/a.zarr"], "unknown workload 'poetry'"),
    ("trace-no-max-new-tokens", ["trace", "--model", "{TINY}", "--prompt", "hi", "--out", "{TMP}/a.zarr"], "--max-new-tokens is required"),
    ("trace-shard-3-of-2", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--shard", "3/2", "--out", "{TMP}/a.zarr"], "--shard takes i/n with 0 ≤ i < n"),
    ("trace-shard-with-dask", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--shard", "0/2", "--dask", "local:2", "--out", "{TMP}/a.zarr"], "--shard and --dask do not go together"),
    ("trace-finalize-missing", ["trace", "--finalize", "{TMP}/missing.zarr"], "no trace store at"),
    ("trace-empty-prompt", ["trace", "--model", "{TINY}", "--prompt", "  ", "--max-new-tokens", "2", "--out", "{TMP}/a.zarr"], "--prompt is empty"),
    # -- info, verify ---------------------------------------------------------------------------
    ("info-missing", ["info", "{TMP}/missing.zarr"], "no trace store at"),
    ("info-a-file", ["info", "{FILE}"], "is not a Zarr v3 store"),
    ("info-a-replay-result", ["info", "{RESULT}"], "is not a kvscope trace"),
    ("verify-missing", ["verify", "{TMP}/missing.zarr"], "no trace store at"),
    # -- compact --------------------------------------------------------------------------------
    ("compact-unknown-format", ["compact", "{PLAIN}", "{TMP}/c.zarr", "--rows", "log8"], "'log8' is not a row format"),
    ("compact-no-format", ["compact", "{PLAIN}", "{TMP}/c.zarr"], "--rows"),
    ("compact-level-range", ["compact", "{PLAIN}", "{TMP}/c.zarr", "--rows", "round4", "--level", "12"], "--level must be an integer in 1..9 (got 12)"),
    ("compact-missing", ["compact", "{TMP}/missing.zarr", "{TMP}/c.zarr", "--rows", "round4"], "no trace store at"),
    ("compact-onto-its-input", ["compact", "{PLAIN}", "{PLAIN}", "--rows", "round4"], "overlaps the input store"),
    ("compact-a-replay-result", ["compact", "{RESULT}", "{TMP}/c.zarr", "--rows", "round4"], "is not a kvscope trace"),
    ("compact-out-in-proc", ["compact", "{PLAIN}", "/proc/c.zarr", "--rows", "round4"], "OUT /proc/c.zarr: cannot write in /proc"),
    # -- analyze --------------------------------------------------------------------------------
    ("analyze-unknown-metric", ["analyze", "entropy", "{QKV}"], "invalid choice: 'entropy'"),
    ("fmm-horizon-0", ["analyze", "fmm", "{QKV}", "--horizon", "0"], "fmm --horizon must be ≥ 1 (got 0)"),
    ("fmm-top-frac-1.5", ["analyze", "fmm", "{QKV}", "--top-frac", "1.5"], "fmm --top-frac must lie in (0, 1) (got 1.5)"),
    ("churn-top-frac-nan", ["analyze", "churn", "{QKV}", "--top-frac", "nan"], "churn --top-frac must be a finite number"),
    ("lir-h-lir-0", ["analyze", "lir", "{QKV}", "--h-lir", "0"], "lir --h-lir must be ≥ 1 (got 0)"),
    ("lir-m-0", ["analyze", "lir", "{QKV}", "--m", "0"], "lir --m must be ≥ 1 (got 0)"),
    ("lir-delta-x", ["analyze", "lir", "{QKV}", "--delta", "x"], "lir --delta must be an integer (got 'x')"),
    ("peaks-top-k-0", ["analyze", "peaks", "{QKV}", "--top-k", "0"], "peaks --top-k must be ≥ 1 (got 0)"),
    ("peaks-logquant-window-0", ["analyze", "peaks", "{QKV}", "--logquant-window", "0"], "peaks --logquant-window must be ≥ 1"),
    ("fmm-bootstrap-0", ["analyze", "fmm", "{QKV}", "--bootstrap", "0"], "fmm --bootstrap must be ≥ 1 (got 0)"),
    ("churn-bootstrap-negative", ["analyze", "churn", "{QKV}", "--bootstrap", "-1"], "churn --bootstrap must be ≥ 1 (got -1)"),
    ("fmm-empty-layers", ["analyze", "fmm", "{QKV}", "--layers", "3-1"], "fmm --layers must list indices"),
    ("lir-layers-outside", ["analyze", "lir", "{QKV}", "--layers", "99"], "--layers outside 0..1"),
    ("churn-heads-outside", ["analyze", "churn", "{QKV}", "--heads", "9"], "--heads outside 0..1"),
    ("fmm-sinks-1000", ["analyze", "fmm", "{QKV}", "--sinks", "1000"], "--sinks 1000 and --window 8 leave no unit"),
    ("peaks-sinks-1000", ["analyze", "peaks", "{QKV}", "--sinks", "1000"], "--sinks 1000 leaves no key"),
    ("fmm-local-negative", ["analyze", "fmm", "{QKV}", "--local", "-1"], "fmm --local must be ≥ 0 (got -1)"),
    ("concentration-every-0", ["analyze", "concentration", "{QKV}", "--every", "0"], "concentration --every must be ≥ 1"),
    ("drift-window-6", ["analyze", "drift", "{QKV}", "--window", "6"], "--window must be a positive multiple of 4"),
    ("fmm-granularity", ["analyze", "fmm", "{QKV}", "--granularity", "diagonal"], "must be one of window, token"),
    ("fmm-resample", ["analyze", "fmm", "{QKV}", "--resample", "prompts"], "must be one of samples, units"),
    ("fmm-policy-alone", ["analyze", "fmm", "{QKV}", "--policy", "h2o"], "--policy and --budget go together"),
    ("peaks-policy", ["analyze", "peaks", "{QKV}", "--policy", "h2o", "--budget", "0.3"], "--policy applies to fmm, lir and churn, not peaks"),
    ("fmm-plot-format", ["analyze", "fmm", "{QKV}", "--plot", "{TMP}/f.xyz"], "unknown figure format 'xyz'"),
    ("fmm-plot-below-a-file", ["analyze", "fmm", "{QKV}", "--plot", "{FILE}/f.png"], "is a file, not a folder"),
    ("fmm-plot-a-folder", ["analyze", "fmm", "{QKV}", "--plot", "{TMP}"], "is a folder"),
    ("fmm-plot-in-proc", ["analyze", "fmm", "{QKV}", "--plot", "/proc/f.png"], "--plot /proc/f.png: cannot write in /proc"),
    ("fmm-plot-missing-folder", ["analyze", "fmm", "{QKV}", "--plot", "{TMP}/no/f.png"], "/scratch/no does not exist"),
    ("fmm-dask", ["analyze", "fmm", "{QKV}", "--dask", "nowhere"], "--dask takes local:N or tcp://"),
    ("fmm-from-qk-without-qk", ["analyze", "fmm", "{PLAIN}", "--from-qk"], "no recorded q/k"),
    ("concentration-horizon", ["analyze", "concentration", "{QKV}", "--horizon", "5"], "unrecognized arguments: --horizon 5"),
    # -- replay, compare ------------------------------------------------------------------------
    ("replay-unknown-policy", ["replay", "{QKV}", "--policies", "nope", "--budgets", "0.3"], "unknown policy 'nope'"),
    ("replay-h2o-recent-frac", ["replay", "{QKV}", "--policies", "h2o:recent_frac=-1", "--budgets", "0.3"], "h2o parameter recent_frac must lie in [0, 1] (got -1.0)"),
    ("replay-oracle-horizon", ["replay", "{QKV}", "--policies", "oracle:horizon=0", "--budgets", "0.3"], "oracle parameter horizon must be ≥ 1 (got 0)"),
    ("replay-qevict-w", ["replay", "{QKV}", "--policies", "qevict:w=0", "--budgets", "0.3"], "qevict parameter w must be a positive multiple of 4 (got 0)"),
    ("replay-recent-frac-nan", ["replay", "{QKV}", "--policies", "h2o:recent_frac=nan", "--budgets", "0.3"], "h2o parameter recent_frac must be a finite number"),
    ("replay-unknown-parameter", ["replay", "{QKV}", "--policies", "h2o:q_frac=1", "--budgets", "0.3"], "policy h2o has no parameter 'q_frac'"),
    ("replay-kivi-residual", ["replay", "{QKV}", "--policies", "kivi:R=7", "--budgets", "0.3"], "kivi parameter R must be a multiple of G=32"),
    ("replay-snapkv-kernel", ["replay", "{QKV}", "--policies", "snapkv:kernel=4", "--budgets", "0.3"], "snapkv parameter kernel must be a positive odd number"),
    ("replay-bits", ["replay", "{QKV}", "--policies", "qevict:bits=3", "--budgets", "0.3"], "qevict parameter bits must be one of 2, 4, 8"),
    ("replay-budget-0", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0"], "budget must lie in (0, 1]"),
    ("replay-budget-text", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "x"], "budget must be a number in (0, 1]"),
    ("replay-budget-twice", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3,0.3"], "a budget is listed twice"),
    ("replay-observe", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--observe", "sideways"], "observe must be renorm or exact"),
    ("replay-unknown-press", ["replay", "{QKV}", "--policies", "press:NoSuchPress", "--budgets", "0.3"], "unknown press 'NoSuchPress' (kvpress has:"),
    ("replay-press-no-class", ["replay", "{QKV}", "--policies", "press", "--budgets", "0.3"], "press:<PressClass>"),
    ("replay-press-unknown-parameter", ["replay", "{QKV}", "--policies", "press:SnapKVPress:window=8", "--budgets", "0.3"], "press SnapKVPress has no parameter 'window'"),
    ("replay-press-badly-typed", ["replay", "{QKV}", "--policies", "press:SnapKVPress:window_size=wide", "--budgets", "0.3"], "window_size must be int (got 'wide')"),
    ("replay-press-ratio-given", ["replay", "{QKV}", "--policies", "press:KnormPress:compression_ratio=0.5", "--budgets", "0.3"], "compression_ratio is set from the budget"),
    ("replay-press-needs-a-scorer", ["replay", "{QKV}", "--policies", "press:AdaKVPress", "--budgets", "0.3"], "needs press=<press>"),
    ("replay-press-wrong-nested-kind", ["replay", "{QKV}", "--policies", "press:AdaKVPress:press=DecodingPress", "--budgets", "0.3"], "must be a press of kind ScorerPress"),
    ("replay-press-kvpress-check", ["replay", "{QKV}", "--policies", "press:AdaKVPress:press=KnormPress:alpha_safeguard=2", "--budgets", "0.3"], "alpha_safeguard should be in [0, 1]"),
    ("replay-press-hub-asset", ["replay", "{QKV}", "--policies", "press:QFilterPress", "--budgets", "0.3"], "press QFilterPress needs its learned Q-filters from hub nthngdy/"),
    ("replay-press-local-asset-missing", ["replay", "{QKV}", "--policies", "press:QFilterPress:asset={TMP}/none", "--budgets", "0.3"], "is not a folder"),
    ("replay-press-window-not-given", ["replay", "{QKV}", "--policies", "press:FinchPress", "--budgets", "0.3"], "press FinchPress needs window_size=N"),
    ("replay-press-threshold-not-given", ["replay", "{QKV}", "--policies", "press:DMSPress:press=KnormPress", "--budgets", "0.3"], "has no ratio a budget can set (it evicts by a score threshold): give threshold=…"),
    ("replay-press-lazy-threshold-not-given", ["replay", "{QKV}", "--policies", "press:SimLayerKVPress", "--budgets", "0.3"], "give lazy_threshold=…"),
    ("replay-press-list-unclosed", ["replay", "{QKV}", "--policies", "press:ComposedPress:presses=[KnormPress", "--budgets", "0.3"], "unbalanced brackets"),
    ("replay-press-without-qkv", ["replay", "{PLAIN}", "--policies", "press:KnormPress", "--budgets", "0.3"], "press:KnormPress needs recorded q/k/v"),
    ("validate-press-hub-asset", ["validate", "{QKV}", "--policy", "press:KVzapPress", "--budget", "0.3"], "press KVzapPress needs its KVzap surrogate model from hub nvidia/KVzap-mlp-"),
    ("run-press-hub-asset", ["run", "--model", "{TINY}", "--prompt", "hi", "--policy", "press:QFilterPress", "--budget", "0.3"], "press QFilterPress needs its learned Q-filters from hub nthngdy/"),
    ("trace-policy-press-window-past-the-prompt", ["trace", "--model", "{TINY}", "--prompt", "The quick brown fox jumps over the lazy dog.", "--max-new-tokens", "2", "--policy", "press:SnapKVPress:window_size=100", "--budget", "0.3", "--out", "{TMP}/a.zarr"], "should be greater than the window size 100"),
    ("trace-policy-press-hub-asset", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--policy", "press:QFilterPress", "--budget", "0.3", "--out", "{TMP}/a.zarr"], "needs its learned Q-filters from hub"),
    ("trace-policy-press-renumbers", ["trace", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--policy", "press:KeyRerotationPress:press=KnormPress", "--budget", "0.3", "--out", "{TMP}/a.zarr"], "numbers the continuation from the rows it keeps"),
    ("trace-question-agnostic-no-question", ["trace", "--model", "{TINY}", "--prompt", "hi there", "--max-new-tokens", "2", "--question-agnostic", "--out", "{TMP}/a.zarr"], "has no question: --question-agnostic needs"),
    ("trace-prompts-context-without-question", ["trace", "--model", "{TINY}", "--prompts", "{HALF}", "--max-new-tokens", "2", "--out", "{TMP}/a.zarr"], "'context' and 'question' must both be non-empty strings"),
    ("replay-question-agnostic-on-a-plain-trace", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--question-agnostic"], "needs a trace recorded with kvscope trace --question-agnostic"),
    ("run-question-agnostic-no-question", ["run", "--model", "{TINY}", "--prompt", "hi there", "--policy", "h2o", "--budget", "0.3", "--question-agnostic"], "has no question"),
    ("validate-question-agnostic-on-a-plain-trace", ["validate", "{QKV}", "--policy", "h2o", "--budget", "0.3", "--question-agnostic"], "prefilled the question with the context"),
    ("replay-exact-without-qkv", ["replay", "{PLAIN}", "--policies", "h2o", "--budgets", "0.3", "--observe", "exact"], "observe=exact needs recorded q/k/v"),
    ("replay-out-exists", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--out", "{RESULT}"], "exists; choose another --out"),
    ("replay-out-is-the-input", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--out", "{QKV}"], "overlaps the input store"),
    ("replay-out-below-a-file", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--out", "{FILE}/r.zarr"], "is a file, not a folder"),
    ("replay-out-in-proc", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--out", "/proc/r.zarr"], "--out /proc/r.zarr: cannot write in /proc"),
    ("replay-plot-in-proc", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--plot", "/proc/r.png"], "--plot /proc/r.png: cannot write in /proc"),
    ("replay-plot-missing-folder", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--plot", "/nonexistent/dir/r.png"], "the folder /nonexistent/dir does not exist"),
    ("replay-horizon-0", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--horizon", "0"], "--horizon must be ≥ 1"),
    ("replay-every-0", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--every", "0"], "every must be ≥ 1"),
    ("replay-window-store", ["replay", "{WIN}", "--policies", "h2o", "--budgets", "0.3"], "replay needs token-resolution rows"),
    ("compare-a-trace", ["compare", "{PLAIN}"], "is not a kvscope replay result"),
    ("compare-missing", ["compare", "{TMP}/missing.zarr"], "no replay result at"),
    ("compare-plot-format", ["compare", "{RESULT}", "--plot", "{TMP}/c.bmpx"], "unknown figure format 'bmpx'"),
    ("compare-plot-in-proc", ["compare", "{RESULT}", "--plot", "/proc/c.png"], "--plot /proc/c.png: cannot write in /proc"),
    ("compare-plot-missing-folder", ["compare", "{RESULT}", "--plot", "{TMP}/no/c.png"], "/scratch/no does not exist"),
    # -- run, validate --------------------------------------------------------------------------
    ("run-oracle", ["run", "--model", "{TINY}", "--prompt", "hi", "--policy", "oracle", "--budget", "0.3"], "clairvoyant"),
    ("run-budget-0", ["run", "--model", "{TINY}", "--prompt", "hi", "--policy", "h2o", "--budget", "0"], "budget must lie in (0, 1]"),
    ("run-kv-dtype", ["run", "--model", "{TINY}", "--prompt", "hi", "--policy", "h2o", "--budget", "0.3", "--kv-dtype", "int8"], "--kv-dtype must be model, float16"),
    ("run-model-dtype", ["run", "--model", "{TINY}", "--prompt", "hi", "--policy", "h2o", "--budget", "0.3", "--model-dtype", "float7"], "--model-dtype must be one of auto, float32, bfloat16, float16 (got 'float7')"),
    ("run-max-new-tokens-0", ["run", "--model", "{TINY}", "--prompt", "hi", "--policy", "h2o", "--budget", "0.3", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    ("validate-without-qkv", ["validate", "{PLAIN}", "--policy", "h2o", "--budget", "0.3"], "validate needs a trace recorded with --record qkv"),
    ("validate-oracle", ["validate", "{QKV}", "--policy", "oracle", "--budget", "0.3"], "clairvoyant"),
    ("validate-live-out-is-the-input", ["validate", "{QKV}", "--policy", "h2o", "--budget", "0.3", "--live-out", "{QKV}", "--force"], "overlaps the input store"),
    # -- the rest -------------------------------------------------------------------------------
    ("unknown-command", ["explain", "{QKV}"], "invalid choice: 'explain'"),
    ("models-unknown-flag", ["models", "--verbose"], "unrecognized arguments: --verbose"),
    ("policies-unknown-flag", ["policies", "--verbose"], "unrecognized arguments: --verbose"),
    ("replay-option-not-abbreviated", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--force"], "unrecognized arguments: --force"),
    # -- allocations and tune -------------------------------------------------------------------
    ("replay-allocation-unknown", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--allocation", "tilted"], "unknown allocation 'tilted'"),
    ("replay-pyramid-beta", ["replay", "{QKV}", "--policies", "h2o", "--budgets", "0.3", "--allocation", "pyramid:beta=0.5"], "pyramid parameter beta must be ≥ 1 (got 0.5)"),
    ("replay-oracle-output-no-qkv", ["replay", "{PLAIN}", "--policies", "h2o", "--budgets", "0.3", "--allocation", "oracle:measure=output"], "needs recorded q/k/v"),
    ("run-oracle-allocation", ["run", "--model", "{TINY}", "--prompt", "hi", "--max-new-tokens", "2", "--policy", "h2o", "--budget", "0.3", "--allocation", "oracle"], "only kvscope validate"),
    ("tune-unknown-allocation", ["tune", "{QKV}", "--policy", "h2o", "--budget", "0.3", "--allocation", "nope"], "unknown allocation 'nope'"),
    ("tune-output-error-no-qkv", ["tune", "{PLAIN}", "--policy", "h2o", "--budget", "0.3", "--objective", "output-error"], "needs recorded q/k/v"),
    ("tune-check-empty", ["tune", "{QKV}", "--policy", "h2o", "--budget", "0.3", "--check", ""], "--check needs held-out prompts"),
    ("tune-space-range", ["tune", "{QKV}", "--policy", "h2o", "--budget", "0.3", "--space", "recent_frac=2:3"], "h2o parameter recent_frac must lie in [0, 1] (got 2.0)"),
    ("tune-out-missing-folder", ["tune", "{QKV}", "--policy", "h2o", "--budget", "0.3", "--trials", "2", "--out", "{TMP}/no/t.json"], "/scratch/no does not exist"),
    ("tune-out-in-proc", ["tune", "{QKV}", "--policy", "h2o", "--budget", "0.3", "--trials", "2", "--out", "/proc/t.json"], "--out /proc/t.json: cannot write in /proc"),
    ("workloads-unknown-flag", ["workloads", "--all"], "unrecognized arguments: --all"),
    # -- view -----------------------------------------------------------------------------------
    ("view-missing", ["view", "{TMP}/missing.zarr"], "no trace store at"),
    ("view-a-replay-result", ["view", "{RESULT}"], "is not a kvscope trace"),
    ("view-result-of-another-trace", ["view", "{WIN}", "--replay", "{RESULT}"], "does not match the trace"),
    ("view-replay-a-trace", ["view", "{PLAIN}", "--replay", "{QKV}"], "is not a kvscope replay result"),
    ("view-port-range", ["view", "{PLAIN}", "--port", "70000"], "--port 70000 is not a port"),
    ("view-html-not-html", ["view", "{PLAIN}", "--html", "{TMP}/page.png"], "name a file ending in .html"),
    ("view-html-in-proc", ["view", "{PLAIN}", "--html", "/proc/page.html"], "--html /proc/page.html: cannot write in /proc"),
    ("view-html-missing-folder", ["view", "{PLAIN}", "--html", "{TMP}/no/page.html"], "/scratch/no does not exist"),
    ("view-tokens", ["view", "{PLAIN}", "--tokens", "text"], "invalid choice: 'text'"),
]  # fmt: skip


@pytest.fixture(scope="module")
def places(tmp_path_factory, tiny_models) -> dict:
    """The inputs the corpus names: small real stores, a replay result, a file, a folder."""
    base = tmp_path_factory.mktemp("corpus")
    model = str(tiny_models["llama"])
    qkv, win, plain = base / "qkv.zarr", base / "win.zarr", base / "plain.zarr"
    kvscope.trace(PROMPT, qkv, model=model, max_new_tokens=12, block_steps=4, record_qkv=True, stop_at_eos=False)
    kvscope.trace(PROMPT, win, model=model, max_new_tokens=8, resolution="window", window=4, stop_at_eos=False)
    kvscope.trace(PROMPT, plain, model=model, max_new_tokens=12, block_steps=4, stop_at_eos=False)
    result = base / "result.zarr"
    run_cli("replay", qkv, "--policies", "h2o", "--budgets", "0.5", "--out", result, "--quiet", check=True)
    file = base / "a-file.txt"
    file.write_text("not a store")
    half = base / "half.jsonl"
    half.write_text('{"context": "a context without its question"}\n')
    tmp = base / "scratch"
    tmp.mkdir()
    return {
        "QKV": qkv,
        "WIN": win,
        "PLAIN": plain,
        "RESULT": result,
        "FILE": file,
        "HALF": half,
        "TMP": tmp,
        "TINY": model,
    }


def refused(ran, needle: str) -> bool:
    """Exit 2 and exactly one stderr line, ``kvscope: error: …`` holding ``needle``."""
    lines = ran.stderr.strip().splitlines()
    return ran.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvscope: error: ") and needle in lines[0]


def argv(args: list[str], places: dict) -> list[str]:
    return [a.format(**places) for a in args]


def untouched(places: dict, run) -> list[str]:
    """Run the cases through ``run``; the names of those not refused as they should be. Checks
    that no input store changed and that nothing was created where outputs were refused."""
    stores = [places[k] for k in ("QKV", "WIN", "PLAIN", "RESULT")]
    before = [tree_digest(p) for p in stores]
    failures = run()
    assert [tree_digest(p) for p in stores] == before
    assert not any(places["TMP"].iterdir())
    return failures


def test_every_bad_input_is_one_line_and_changes_nothing(places):
    """All cases through the CLI's ``main`` in this process (the code a subprocess runs)."""
    assert len(CASES) >= 60 and len({name for name, _, _ in CASES}) == len(CASES)

    def run():
        return [
            f"{name}: {ran}"
            for name, args, needle in CASES
            if not refused(ran := run_main(*argv(args, places)), needle)
        ]

    failures = untouched(places, run)
    assert not failures, "\n".join(failures)


def test_as_real_subprocesses(places):
    """The first case of every subcommand as a real ``kvscope`` process: nothing the process
    adds (imports, warnings, logging, exit) breaks the one line."""
    first = {}
    for case in CASES:
        first.setdefault(case[1][0], case)

    def one(case):
        name, args, needle = case
        proc = run_cli(*argv(args, places), env={"HF_HUB_OFFLINE": "1"})
        return (
            None
            if refused(proc, needle) and "Traceback" not in proc.stderr
            else f"{name}: {proc.returncode} {proc.stderr!r}"
        )

    def run():
        with ThreadPoolExecutor(2) as pool:
            return [f for f in pool.map(one, first.values()) if f]

    failures = untouched(places, run)
    assert not failures, "\n".join(failures)


def test_the_corpus_covers_every_subcommand():
    from kvscope.cli import build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)
    named = {args[0] for _, args, _ in CASES}
    assert commands <= named, commands - named
    metrics = {args[1] for _, args, _ in CASES if args[0] == "analyze"}
    assert set(kvscope.analysis.available()) <= metrics, set(kvscope.analysis.available()) - metrics
    assert json.dumps(CASES)  # plain data: names, argv and the phrase each must print
