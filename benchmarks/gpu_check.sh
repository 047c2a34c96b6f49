#!/usr/bin/env bash
# There, on a lent GPU machine (run benchmarks/gpu_prepare.sh here first; carry .gpu):
#   device run: bash benchmarks/gpu_check.sh        carry: [".gpu"]        timeout_s: 600
# Installs the carried wheels beside the machine's own torch and transformers, then runs
# benchmarks/gpu_check.py (capture vs eager on CUDA, trace overhead at 1K and 8K tokens, a
# replay) within 9 minutes; the report lands in $OUT/gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, zarr, kvscope; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'zarr', zarr.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 540 python3 benchmarks/gpu_check.py --device cuda --tokenizer .gpu/tokenizer --out "${OUT:-.}/gpu_check.json"
