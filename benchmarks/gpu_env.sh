# Sourced by the scripts run on a lent GPU machine (gpu_run.sh, gpu_eval_train.sh): the wheels its
# image lacks, carried in $WHEELS (benchmarks/gpu_wheels.sh fetches them here first), installed into
# /tmp/site without their dependencies (nothing can be fetched there); then what the machine is and
# which versions it runs. Reads PYTHON, WHEELS and MODULES (the Python modules whose versions to print).
PYTHON=${PYTHON:-python3} WHEELS=${WHEELS:-.whl}
MODULES=${MODULES:-jax jaxlib flax numpy safetensors huggingface_hub torch}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    --find-links "$WHEELS" $(ls "$WHEELS" | sed 's/-.*//' | sort -u) \
    && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
lscpu | grep -E "^Model name|^CPU\(s\)"; free -g | head -2; df -h /tmp | tail -1; ulimit -l
"$PYTHON" - $MODULES <<'PY'
import importlib, sys
print(sys.version.split()[0])
for name in sys.argv[1:]:
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:  # noqa: BLE001 (report and go on)
        print(name, "MISSING", type(e).__name__, e)
import jax
print(jax.devices())
PY
