#!/usr/bin/env bash
# Installs polytrain and every backend into ./.venv. Safe to re-run: each step
# is skipped when what it installs already imports.
#
#   scripts/setup.sh            everything (torch, ray, lightning, tune, fairscale,
#                               deepspeed, tensorflow + tf-keras, hydra, horovod, the docs tools)
#   SKIP_HOROVOD=1 scripts/setup.sh   everything but the Horovod build
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

log() { printf '\n==> %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
pip() { python -m pip --disable-pip-version-check "$@"; }

log "pip, wheel, setuptools"
pip install -q --upgrade "pip>=24" wheel "setuptools<81"

# torch first and pinned: every other package below builds or resolves against it.
# 2.13.0 CPU is the build this project is tested with; a bare `torch` would pull a
# multi-GB CUDA build.
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if ! python -c "import torch" 2>/dev/null; then
  log "installing $TORCH_SPEC"
  pip install -q "$TORCH_SPEC"
fi

log "polytrain with the pure-Python extras (ray, lightning, tune, fairscale, tensorflow, trackers, hf, trl, hydra, docs, dev)"
pip install -q -e ".[lightning,tune,fairscale,tensorflow,trackers,hf,trl,hydra,docs,dev]"

# DeepSpeed's setup.py imports torch, so it must see the torch installed above
# (no build isolation), and DS_BUILD_OPS=0 skips compiling CUDA/C++ ops: on CPU
# it JIT-builds only a small communication extension on first use.
if ! python -c "import deepspeed" 2>/dev/null; then
  log "installing deepspeed (DS_BUILD_OPS=0)"
  DS_BUILD_OPS=0 pip install -q --no-build-isolation "deepspeed==0.19.8"
fi

if [ "${SKIP_HOROVOD:-0}" != 1 ]; then
  bash scripts/install_horovod.sh
fi

# Every backend in one environment must agree; fail here, not in the middle of the tests.
log "checking the environment"
python -m pip check
log "installed backends"
python -m polytrain.compat.imports 2>/dev/null || true
