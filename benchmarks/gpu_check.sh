#!/usr/bin/env bash
# On a CUDA machine with torch (run benchmarks/gpu_prepare.sh first where pip works; copy the
# checkout with .gpu/ to the machine): bash benchmarks/gpu_check.sh
# Installs the wheels in .gpu/ beside the machine's own torch, then runs benchmarks/gpu_check.py
# (capture vs eager on CUDA, trace overhead at 1K and 8K tokens, a replay) and
# benchmarks/gpu_profile.py (where a traced prefill and decode spend their time at 8K tokens),
# within 9 minutes; the reports land in $OUT (default: the current folder): gpu_check.json,
# gpu_profile.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, zarr, kvscope; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'zarr', zarr.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 400 python3 benchmarks/gpu_check.py --device cuda --tokenizer .gpu/tokenizer --out "${OUT:-.}/gpu_check.json"
timeout 120 python3 benchmarks/gpu_profile.py --device cuda --tokenizer .gpu/tokenizer --out "${OUT:-.}/gpu_profile.txt" >/dev/null
