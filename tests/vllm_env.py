"""The separate vLLM environment the vLLM tests launch servers from (scripts/vllm_env.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"

# The marks of a module whose tests launch vLLM servers: slow integration tests, skipped
# (saying how to build it) where the environment is missing.
VLLM_MARKS = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM environment: create .venv-vllm with "
                       "scripts/vllm_env.sh (make vllm)"),
]
