#!/usr/bin/env bash
# Create BFCL's own environment (.venv-bfcl), where the BFCL v4 checker runs (envs/bfcl/).
# bfcl-eval pins numpy 1.26.4 and pulls every vendor SDK its model handlers use (its AST
# checker imports them all through bfcl_eval.constants.model_config), and sentence-transformers,
# which brings a CUDA torch unless the CPU torch is there first: it cannot share the project's
# environment, so it lives in its own venv and answers over HTTP (envs/bfcl/grader_server.py).
# qwen-agent, one of its dependencies, imports soundfile without declaring it: installed here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
VENV=${BFCL_VENV:-.venv-bfcl}
BFCL_VERSION=${BFCL_VERSION:-2026.3.23}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# Built once per machine (about 2 GB) in a cache folder keyed by this script, the versions,
# Python and the architecture, and linked as .venv-bfcl: a fresh checkout (CI) finds it ready.
KEY=$( (cat "$0"; echo "$BFCL_VERSION $TORCH_VERSION"; "$PY" -V; uname -m) | sha256sum | cut -c1-16)
CACHED=${AGENTRFT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrft}/venv-bfcl-$KEY
if [ -f "$CACHED/.installed" ]; then
  ln -sfn "$CACHED" "$VENV"
  echo "BFCL environment: $CACHED (cached)"
  exit 0
fi
rm -rf "$CACHED"
mkdir -p "$(dirname "$CACHED")"
"$PY" -m venv "$CACHED"
if [ -e "$VENV" ] && [ ! -L "$VENV" ]; then rm -rf "$VENV"; fi
ln -sfn "$CACHED" "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip install -q "bfcl-eval==$BFCL_VERSION" "torch==$TORCH_VERSION" soundfile
# The checker with every handler, as the grader server loads it (BFCL writes its result and
# score folders under BFCL_PROJECT_ROOT at import: a scratch folder here).
BFCL_PROJECT_ROOT=$(mktemp -d) "$VENV/bin/python" -c "
import importlib.metadata as m
from bfcl_eval.eval_checker import eval_runner
print('bfcl-eval', m.version('bfcl-eval'), 'numpy', m.version('numpy'), 'torch', m.version('torch'))"
touch "$CACHED/.installed"
