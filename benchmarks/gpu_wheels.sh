#!/usr/bin/env bash
# Fetch, on this machine, the wheels a lent GPU machine's image lacks (nothing can be fetched there):
# they travel in .whl/ (untracked) with the working tree, and benchmarks/gpu_env.sh installs them.
# Pure-Python wheels once; compiled ones for each CPython the image may run (3.10 to 3.13).
#
#   bash benchmarks/gpu_wheels.sh        # then: bash benchmarks/gpu_run.sh / gpu_eval_train.sh there
set -euo pipefail
WHEELS=${WHEELS:-.whl}
PURE="huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 transformers==5.24.0
      typer==0.29.2 shellingham==1.5.4 click==8.5.1 optax==0.2.8 absl-py==2.5.1"
COMPILED="fastsafetensors==0.5.0 regex>=2025.10.22 tokenizers==0.23.3"  # regex: the newest for each Python
mkdir -p "$WHEELS"
pip download -q --no-deps --only-binary=:all: -d "$WHEELS" $PURE
for version in 3.10 3.11 3.12 3.13; do
  pip download -q --no-deps --only-binary=:all: --python-version "$version" --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$WHEELS" $COMPILED
done
ls "$WHEELS"; du -sh "$WHEELS"
