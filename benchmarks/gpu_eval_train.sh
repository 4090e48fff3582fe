#!/usr/bin/env bash
# Issues 31 and 35 in one prepared call on a lent GPU machine (nothing can be fetched there; the wheels
# its image lacks travel in .whl/: bash benchmarks/gpu_wheels.sh here first):
#  1. issue 31's eval job (bench_eval_job: a random 1.1 B Llama in bf16, 256 texts of 64-1,000 words,
#     --max-len 1024, batch 8): otfload eval's first and repeated job against transformers' job, end to
#     end, with the targets' verdicts (first <= 1.0x, repeated <= 0.5x, scoring >= 5x);
#  2. issue 35's training start-up (bench_train_startup on the same shape, float32 + AdamW on the GPU):
#     the train step compiled while the weights load against load then compile, one round.
#
#   bash benchmarks/gpu_eval_train.sh          # ~4 min on a GPU (timeouts add up to 8 min)
#   PLATFORM=cpu PRESET=tiny TEXTS=16 MAX_LEN=256 TRAIN_PRESET=tiny bash benchmarks/gpu_eval_train.sh  # dry run
set -uo pipefail
OUT=${OUT:-/tmp/otfload-gpu} PLATFORM=${PLATFORM:-gpu}
PRESET=${PRESET:-1b} TEXTS=${TEXTS:-256} MAX_LEN=${MAX_LEN:-1024} TRAIN_PRESET=${TRAIN_PRESET:-1b}
mkdir -p "$OUT"
MODULES="jax jaxlib flax optax numpy safetensors huggingface_hub tokenizers torch transformers"
source "$(dirname "$0")/gpu_env.sh"  # the carried wheels installed; the machine and its versions printed
timeout 300 "$PYTHON" -m benchmarks.bench_eval_job --platform "$PLATFORM" --preset "$PRESET" --texts "$TEXTS" \
  --max-len "$MAX_LEN" --json "$OUT/eval_job.json" 2>&1 | tee "$OUT/eval_job.txt"
timeout 180 "$PYTHON" -m benchmarks.bench_train_startup --platform "$PLATFORM" --preset "$TRAIN_PRESET" --rounds 1 \
  --json 2>&1 | tee "$OUT/train_startup.txt"
