#!/usr/bin/env bash
# Here, before a GPU session: what benchmarks/gpu_check.sh needs on a lent GPU machine that has
# torch and transformers but no zarr and no package index (docs: the device tool's README).
#   .gpu/whl/        wheels for CPython 3.12 on x86-64 (zarr and its codecs, dask, xarray)
#   .gpu/tokenizer/  the default model's tokenizer (the check builds random-weight models)
# .gpu/ is git-ignored; name it in the device call's `carry`. About 17 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/whl .gpu/tokenizer
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu/whl \
    zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 dask==2026.8.0 partd==1.4.2 \
    locket==1.0.0 xarray==2026.9.0
folder=$("$PY" -c "from kvscope.models import resolve; print(resolve('smollm2-135m').load_path)")
cp "$folder"/tokenizer.json "$folder"/tokenizer_config.json "$folder"/chat_template.jinja .gpu/tokenizer/
du -sh .gpu
