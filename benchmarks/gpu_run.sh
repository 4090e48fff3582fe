#!/usr/bin/env bash
# Issue 20 §3 in one call on a lent GPU machine (its image has JAX, torch, safetensors; nothing can be
# fetched there): load GB/s into GPU memory, otfload beside safetensors + device_put, fastsafetensors
# and the host-to-device copy ceilings, warm and cold page cache, after a bitwise check of otfload's
# leaves on the GPU.
#
#   bash benchmarks/gpu_run.sh            # SIZE_GIB=4 REPEAT=3 COLD_REPEAT=2; results under $OUT
#                                         # (~9 min on an H200: near a device call's 10 min limit)
#   SIZE_GIB=2 REPEAT=2 WARM_METHODS=fastsafetensors,otfload-whole,otfload COLD_METHODS= bash benchmarks/gpu_run.sh
#
# Wheels the image lacks (fastsafetensors; huggingface_hub 2 and httpx2, which otfload imports) travel
# in .whl/ (see docs/benchmarks.md, "Into GPU memory") and are installed into /tmp/site.
set -uo pipefail
OUT=${OUT:-/tmp/otfload-gpu}
SIZE_GIB=${SIZE_GIB:-4}
REPEAT=${REPEAT:-3}
COLD_REPEAT=${COLD_REPEAT:-2}
CKPT=${CKPT:-/tmp/otfload-bench-ckpt}
WARM_METHODS=${WARM_METHODS-pinned,pageable,fromfile,h2d,naive,fastsafetensors,fst-jax,orbax,otfload-fresh,otfload-whole,otfload}
COLD_METHODS=${COLD_METHODS-fromfile,h2d,naive,fastsafetensors,orbax,otfload-whole,otfload}
VERIFY_METHODS=${VERIFY_METHODS:-otfload-whole,otfload}
H2D_ROUTES=${H2D_ROUTES-numpy-copy,whole,pieces-64m,pieces-64m-inflight,pieces-64m-freed,pieces-64m-written,torch-pageable,torch-pin}
PLATFORM=${PLATFORM:-gpu} DEVICES=${DEVICES:-1}  # PLATFORM=cpu DEVICES=8: a dry run of this script anywhere
PYTHON=${PYTHON:-python3} WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
lscpu | grep -E "^Model name|^CPU\(s\)"; free -g | head -2; df -h /tmp | tail -1
"$PYTHON" - <<'EOF'
import importlib
for name in ("jax", "jaxlib", "flax", "numpy", "safetensors", "huggingface_hub", "orbax.checkpoint", "torch",
             "fastsafetensors"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:  # noqa: BLE001 (report and go on)
        print(name, "MISSING", type(e).__name__, e)
import jax
print(jax.devices())
EOF
"$PYTHON" -m benchmarks.make_checkpoint --size-gib "$SIZE_GIB" --out "$CKPT" || exit 1
common=(--platform "$PLATFORM" --devices "$DEVICES" --dir "$CKPT")
timeout 90 "$PYTHON" -m benchmarks.bench_load "${common[@]}" --verify --methods "$VERIFY_METHODS" --repeat 1 2>&1 \
  | tee "$OUT/verify.txt" || exit 1
[ -n "$WARM_METHODS" ] && timeout 300 "$PYTHON" -m benchmarks.bench_load "${common[@]}" --repeat "$REPEAT" \
  --methods "$WARM_METHODS" --json "$OUT/warm.json" 2>&1 | tee "$OUT/warm.txt"
[ -n "$COLD_METHODS" ] && timeout 170 "$PYTHON" -m benchmarks.bench_load "${common[@]}" --cold --repeat "$COLD_REPEAT" \
  --methods "$COLD_METHODS" --json "$OUT/cold.json" 2>&1 | tee "$OUT/cold.txt"
[ -n "$H2D_ROUTES" ] && timeout 120 "$PYTHON" -m benchmarks.h2d_routes --gib 2 --routes "$H2D_ROUTES" \
  --json "$OUT/h2d.json" 2>&1 | tee "$OUT/h2d.txt"
