#!/usr/bin/env bash
# On a CUDA machine with torch (run benchmarks/gpu_prepare.sh first where pip works; copy the
# checkout with .gpu/ to the machine): bash benchmarks/gpu_check.sh
# Installs the wheels in .gpu/ beside the machine's own torch, then runs benchmarks/gpu_check.py
# (capture vs eager on CUDA; traced vs untraced prefill, decode, end to end and peak memory at 4 and
# 32 layers of the 8B geometry, 1K/8K/32K prompt tokens, 256 steps; a replay) with a budget of
# 8 minutes, and benchmarks/gpu_profile.py (where a traced prefill and decode spend their time at
# 8K tokens) if a minute and a half is left of 9.5; the reports land in $OUT (default: the current
# folder) as they are made: gpu_check.json (after every section), gpu_profile.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, zarr, kvscope; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'zarr', zarr.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
commit=$(cat .gpu/commit 2>/dev/null || echo unknown)
timeout 510 python3 benchmarks/gpu_check.py --device cuda --tokenizer .gpu/tokenizer --commit "$commit" \
    --budget-s 450 --out "$OUT/gpu_check.json" >/dev/null || echo "gpu_check ended with status $?"
if (( SECONDS < 480 )); then
    timeout $(( 570 - SECONDS )) python3 benchmarks/gpu_profile.py --device cuda --tokenizer .gpu/tokenizer \
        --out "$OUT/gpu_profile.txt" >/dev/null || echo "gpu_profile ended with status $?"
fi
