#!/usr/bin/env bash
# Issue 30 in one prepared call on a lent GPU machine (its image has JAX, torch, safetensors; nothing can
# be fetched there): the machine's limits (all-thread warm read, O_DIRECT cold read, read + put from a
# DMA-registered arena, the pinned copy ceiling) beside the loaders (naive, fastsafetensors, otfload
# without its host ring, otfload with no transfer before it, otfload after one small transfer), warm on
# a SIZE_GIB and a BIG_GIB checkpoint and cold on the first; a bitwise check of otfload's leaves first;
# the first transfer's phases last. Every table ends with issue 30's targets and verdicts.
#
#   bash benchmarks/gpu_run.sh                      # ~7 min on an H200 (its timeouts add up to 9.4 min)
#   PLATFORM=cpu DEVICES=8 SIZE_GIB=0.25 BIG_GIB=0 bash benchmarks/gpu_run.sh   # the dry run, anywhere
#
# Wheels the image lacks (fastsafetensors; huggingface_hub 2 and httpx2, which otfload imports) travel
# in .whl/ (bash benchmarks/gpu_wheels.sh fetches them first) and are installed into /tmp/site.
set -uo pipefail
OUT=${OUT:-/tmp/otfload-gpu}
SIZE_GIB=${SIZE_GIB:-4} BIG_GIB=${BIG_GIB:-16} REPEAT=${REPEAT:-2} COLD_REPEAT=${COLD_REPEAT:-2}
CKPT=${CKPT:-/tmp/otfload-bench-ckpt} BIG_CKPT=${BIG_CKPT:-/tmp/otfload-bench-big}
WARM_METHODS=${WARM_METHODS-floor-all,dma-put,naive,fastsafetensors,otfload-staged,otfload-hosthooks,otfload,otfload-primed}
BIG_METHODS=${BIG_METHODS-dma-put,fastsafetensors,otfload,otfload-primed}
COLD_METHODS=${COLD_METHODS-direct,fastsafetensors,otfload}
VERIFY_METHODS=${VERIFY_METHODS:-otfload}  # hooks on the device (the host route was verified on a GPU before)
FIRST_VARIANTS=${FIRST_VARIANTS-default,eager-modules,no-prealloc,compute-first}
PLATFORM=${PLATFORM:-gpu} DEVICES=${DEVICES:-1}  # PLATFORM=cpu DEVICES=8: a dry run of this script anywhere
mkdir -p "$OUT"
MODULES="jax jaxlib flax numpy safetensors huggingface_hub torch fastsafetensors"
source "$(dirname "$0")/gpu_env.sh"  # the carried wheels installed; the machine and its versions printed
bench() {  # bench SECONDS NAME ARGS...: one bench_load run, its output kept under $OUT
  local limit=$1 name=$2; shift 2
  timeout "$limit" "$PYTHON" -m benchmarks.bench_load --platform "$PLATFORM" --devices "$DEVICES" --lenient "$@" 2>&1 \
    | tee "$OUT/$name.txt"
}
timeout 45 "$PYTHON" -m benchmarks.make_checkpoint --size-gib "$SIZE_GIB" --out "$CKPT" || exit 1
bench 60 verify --dir "$CKPT" --verify --methods "$VERIFY_METHODS" --repeat 1 || exit 1
[ -n "$WARM_METHODS" ] && bench 160 warm --dir "$CKPT" --repeat "$REPEAT" --methods "$WARM_METHODS" \
  --accelerator-targets --json "$OUT/warm.json"
[ -n "$COLD_METHODS" ] && bench 70 cold --dir "$CKPT" --cold --repeat "$COLD_REPEAT" --methods "$COLD_METHODS" \
  --accelerator-targets --json "$OUT/cold.json"
[ -n "$FIRST_VARIANTS" ] && timeout 30 "$PYTHON" -m benchmarks.first_transfer --variants "$FIRST_VARIANTS" \
  --json "$OUT/first.json" 2>&1 | tee "$OUT/first.txt"
rm -rf "$CKPT"  # room for the big one
if [ "$BIG_GIB" != 0 ] && [ -n "$BIG_METHODS" ]; then
  timeout 80 "$PYTHON" -m benchmarks.make_checkpoint --size-gib "$BIG_GIB" --out "$BIG_CKPT" \
    && bench 120 big --dir "$BIG_CKPT" --repeat "$REPEAT" --methods "$BIG_METHODS" --accelerator-targets \
      --json "$OUT/big.json"
fi
