"""A vLLM worker extension that loads the trainer's weights into a running server.

The trainer writes the policy's weights (LoRA merged) as safetensors files after each
optimizer step; `POST /collective_rpc` with `{"method": "agentrft_reload_weights",
"args": [path, version]}` makes every worker of the server read them in place
(`Worker.reload_weights`, which runs each layer's post-load processing again), so
the next request samples with the new policy. The caller then resets the prefix cache:
the cached keys and values of earlier prompts were computed with the old weights.

This module is imported by the vLLM server, in the vLLM environment (`.venv-vllm`),
which has none of the project's dependencies: it imports only the standard library,
torch and safetensors (both come with vLLM), never another project module. Start the
server with this package's parent directory on PYTHONPATH and

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \
        --worker-extension-cls trainer.generation.vllm_worker.WeightSyncExtension

(`VLLM_SERVER_DEV_MODE` exposes `/collective_rpc` and `/reset_prefix_cache`; keep such a
server on a private network or behind its API key).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def _read_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, tensors.get_tensor(name)


class WeightSyncExtension:
    """Mixed into vLLM's worker class: `self` is the worker (`model_runner`, `reload_weights`)."""

    agentrft_version: str = ""

    def agentrft_reload_weights(self, path: str, version: str) -> dict[str, Any]:
        """Load every tensor of the safetensors files in `path` (checkpoint names, as
        transformers saves them) and remember `version`; returns what was read."""
        started = time.perf_counter()
        counted: list[int] = []

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in _read_safetensors(Path(path)):
                counted.append(tensor.numel())
                yield name, tensor

        self.reload_weights(weights_iterator=weights())  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        # On CPU the LM head keeps a prepacked copy of its weight for the GEMM kernel; when it
        # is tied to the embedding the reload refreshes the embedding but not that copy, and
        # the old logits would survive the sync. Packing again from the new weight fixes it.
        lm_head = getattr(model, "lm_head", None)
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(lm_head)
        self.agentrft_version = version
        return {
            "version": version,
            "tensors": len(counted),
            "elements": sum(counted),
            "seconds": time.perf_counter() - started,
        }

    def agentrft_fetch(self, base_url: str, files: list[str], name: str) -> str:
        """Download `files` from the trainer's weight server (`base_url/<file>`) into a folder of
        this server's own, `name` below the system's temporary folder, replacing an earlier one
        of that name; returns its path (the server reads no folder of the trainer's)."""
        root = Path(tempfile.gettempdir()) / "agentrft-weights"
        target, partial = root / name, root / f"{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for file in files:
            with urllib.request.urlopen(f"{base_url}/{file}", timeout=600) as answer, (partial / file).open("wb") as out:
                shutil.copyfileobj(answer, out, 1 << 20)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        return str(target)

    def agentrft_fetch_and_reload(self, base_url: str, files: list[str], version: str) -> dict[str, Any]:
        """`agentrft_fetch` then `agentrft_reload_weights` from the downloaded folder, which is
        removed after the load."""
        started = time.perf_counter()
        local = self.agentrft_fetch(base_url, files, f"full-{version}")
        try:
            loaded = self.agentrft_reload_weights(local, version)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        return {**loaded, "fetched_to": local, "seconds": time.perf_counter() - started}

    def agentrft_info(self) -> dict[str, Any]:
        """What the trainer needs to know before the first sync: the dtype the weights are
        served in and the version last loaded."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        dtype = next(model.parameters()).dtype
        return {"dtype": str(dtype).removeprefix("torch."), "version": self.agentrft_version}
