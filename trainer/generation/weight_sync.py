"""The trainer's weights as a vLLM server loads them: merged LoRA, one safetensors file
replaced whole, the sync mode a config resolves to, vLLM's NCCL weight-transfer calls over
HTTP, and `WeightServer`: the trainer's files over HTTP for servers that cannot read its
folder (`rollout.vllm.weight_source: http`).

The weight server is plain HTTP from a folder of the trainer's run, under a path that
holds a random token (the URL is the credential: bind it to the servers' private network,
as their own development endpoints are). A server downloads what a sync names into a
folder of its own (trainer/generation/vllm_worker.py) and loads it from there."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from trainer.generation.vllm_servers import VllmServers


def merged_state_dict(
    model: torch.nn.Module, dtype: torch.dtype | None = None, *, merge_adapters: bool = True, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """The model's weights under the checkpoint names transformers saves, on `device`, in
    `dtype` if given, LoRA adapters merged (W + scale * B @ A, computed aside: the training model is
    not touched) or, with `merge_adapters=False`, left out. A tied LM head is left out too
    (the server ties it again)."""
    peft = hasattr(model, "get_base_model")  # a PeftModel
    base = model.get_base_model() if peft else model
    deltas: dict[str, torch.Tensor] = {}
    if peft and merge_adapters:
        from peft.tuners.lora import LoraLayer

        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                adapters = [a for a in module.active_adapters if a in module.lora_A]
                if adapters:
                    deltas[f"{name}.weight"] = sum(module.get_delta_weight(a) for a in adapters)
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    weights: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in base.state_dict().items():
            if ".lora_" in name or (tied and name == "lm_head.weight"):
                continue
            name = name.replace(".base_layer.", ".")
            if name in deltas:
                tensor = tensor + deltas[name].to(tensor.dtype)
            weights[name] = tensor.detach().to(device, dtype=dtype or tensor.dtype).contiguous()
    return weights


def save_weights(weights: dict[str, torch.Tensor], directory: Path) -> Path:
    """Write `weights` as `directory/model.safetensors`, replacing the last step's file at once
    (a server never reads half a file)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / "model.safetensors.partial"
    save_file(weights, str(partial))
    os.replace(partial, directory / "model.safetensors")
    return directory


class _HttpWeightSyncClient:
    """vLLM's weight-sync control plane over our HTTP client (retries, API key)."""

    def __init__(self, servers: VllmServers, url: str):
        self.servers, self.url = servers, url

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.servers.post(self.url, "/init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.servers.post(self.url, "/shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.servers.post(self.url, "/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.servers.post(self.url, "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.servers.post(self.url, "/finish_weight_update",
                          {"weight_version": weight_version} if weight_version is not None else None)


def _servable_dir(trainer: Any, fallback: Path) -> str:
    """A model directory a launched server can load: the trainer's own model path when it is
    one, else the trainer's weights written to `fallback` (a hub id or a registry URI)."""
    if Path(trainer.model_path, "config.json").is_file():
        return str(Path(trainer.model_path).resolve())
    model = trainer.sampling_model()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.save_pretrained(str(fallback))
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(str(fallback))
    trainer.tokenizer.save_pretrained(str(fallback))
    # The base weights (without adapters): a LoRA sync puts the adapter on top of them.
    save_weights(merged_state_dict(base, merge_adapters=False), fallback)
    return str(fallback)


# ----------------------------------------------------------------------------------------------
def resolved_sync(vllm_config: Any, lora: Any) -> str:
    """`rollout.vllm.sync` with its default: the adapter when training LoRA, else full weights."""
    return vllm_config.sync or ("lora" if lora is not None else "full")


class WeightServer:
    """Serve the files below `root` at `http://host:port/<token>/<relative path>`."""

    def __init__(self, root: Path, host: str = "127.0.0.1"):
        import http.server
        import secrets
        import threading
        from functools import partial

        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_urlsafe(16)
        token = self.token

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self) -> None:  # only below /<token>/, and no folder listings
                head, _, rest = self.path.lstrip("/").partition("/")
                if head != token or not rest or rest.endswith("/"):
                    self.send_error(404)
                    return
                self.path = "/" + rest
                super().do_GET()

            do_HEAD = do_GET

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((host, 0), partial(Handler, directory=str(self.root)))
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="weight-server")
        self._thread.start()

    def url(self, path: Path) -> str:
        """The URL of `path`, a file or folder below the root."""
        relative = Path(path).resolve().relative_to(self.root).as_posix()
        return f"http://{self.host}:{self.port}/{self.token}/{relative}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
