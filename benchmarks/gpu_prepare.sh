#!/usr/bin/env bash
# Here, before a GPU run: what benchmarks/gpu_check.sh needs on a CUDA machine that has torch
# but no package index (an air-gapped node, say): zarr, dask, xarray and the transformers kvscope
# is tested on (kvscope.model.spec.TRANSFORMERS_TESTED; an older one is refused), with its needs.
#   .gpu/whl/        wheels for CPython 3.12 on x86-64
#   .gpu/tokenizer/  the default model's tokenizer (the check builds random-weight models)
#   .gpu/commit      the commit measured (the copy on the machine has no git history)
# .gpu/ is git-ignored; name it in the device call's `carry`. About 17 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/whl .gpu/tokenizer
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu/whl \
    zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 dask==2026.8.0 partd==1.4.2 \
    locket==1.0.0 xarray==2026.9.0 \
    transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3 kernels==0.19.1 httpx2==2.16.2 httpcore2==2.16.2 \
    truststore==0.10.5 tomlkit==0.15.3 hf-xet==1.8.0 click==8.5.1 idna==3.20 anyio==4.16.0 h11==0.16.0 \
    regex==2026.5.9 safetensors==0.8.0
folder=$("$PY" -c "from kvscope.model.loading import resolve; print(resolve('smollm2-135m').load_path)")
changed=$(git status --porcelain --untracked-files=no)
echo "$(git rev-parse --short HEAD)${changed:+-dirty}" > .gpu/commit
cp "$folder"/tokenizer.json "$folder"/tokenizer_config.json "$folder"/chat_template.jinja .gpu/tokenizer/
du -sh .gpu
