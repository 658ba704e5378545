"""A launched vLLM server's memory, sized to the model, the rollouts and the machine.

No server is started here (tests/trainer/test_vllm_backend.py starts real ones): these
check the arithmetic and which arguments a launch gets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.errors import ConfigError
from trainer.generation import vllm_launch
from trainer.generation.vllm_launch import cpu_thread_env, kv_cache_bytes, server_args

# Qwen3-0.6B's attention: 28 layers, 8 KV heads of 128 dimensions, bf16.
QWEN3_06B = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "hidden_size": 1024, "torch_dtype": "bfloat16"}
PER_TOKEN = 2 * 28 * 8 * 128 * 2  # keys and values: 114,688 bytes a token


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    return tmp_path


def test_room_for_every_concurrent_rollout_when_the_machine_has_it(model_dir: Path):
    wanted = PER_TOKEN * 4096 * 64  # 64 rollouts of 4,096 tokens: 28 GiB
    assert kv_cache_bytes(model_dir, max_model_len=4096, max_concurrent=64, available=100 << 30) == wanted


def test_at_most_half_of_what_is_free_and_at_least_one_sequence(model_dir: Path):
    assert kv_cache_bytes(model_dir, max_model_len=4096, max_concurrent=64, available=8 << 30) == 4 << 30
    with pytest.raises(ConfigError, match="needs 448 MiB of KV cache for one sequence of 4096 tokens"):
        kv_cache_bytes(model_dir, max_model_len=4096, max_concurrent=64, available=512 << 20)


def test_dtype_and_config_shapes(tmp_path: Path):
    # no head_dim, no KV heads (multi-head attention), float32 named by the config
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {
        "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "dtype": "float32"}}))
    assert kv_cache_bytes(tmp_path, max_model_len=100, max_concurrent=3, available=1 << 30) == 2 * 2 * 4 * 16 * 4 * 300
    assert kv_cache_bytes(tmp_path, max_model_len=100, max_concurrent=3, dtype="bfloat16",
                          available=1 << 30) == 2 * 2 * 4 * 16 * 2 * 300


def test_a_launch_is_sized_unless_the_user_says_how_much_memory(model_dir: Path):
    args, _ = server_args(max_model_len=4096, model_dir=model_dir, max_concurrent=2)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(PER_TOKEN * 4096 * 2)
    for given in (["--gpu-memory-utilization", "0.3"], ["--kv-cache-memory-bytes=1000000"]):
        args, _ = server_args(max_model_len=4096, model_dir=model_dir, extra_args=given)
        assert args.count("--kv-cache-memory-bytes") == 0 and args[-len(given):] == given
    with pytest.raises(ConfigError, match="cannot read the model's config"):
        server_args(max_model_len=4096, model_dir=model_dir / "missing")


def test_a_cpu_server_takes_half_the_cores_unbound_unless_the_environment_binds_them(
        monkeypatch: pytest.MonkeyPatch):
    # vLLM's default threads made a batch of rollouts beside an update 1.9-5x slower
    monkeypatch.setattr(vllm_launch.os, "sched_getaffinity", lambda _: set(range(8)))
    assert cpu_thread_env({}) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "4"}
    # the trainer's own OMP_NUM_THREADS (torchrun sets 1) does not size the server
    assert cpu_thread_env({"OMP_NUM_THREADS": "1"})["OMP_NUM_THREADS"] == "4"
    monkeypatch.setattr(vllm_launch.os, "sched_getaffinity", lambda _: {0})
    assert cpu_thread_env({"PATH": "/bin"})["OMP_NUM_THREADS"] == "1"  # at least one
    assert cpu_thread_env({"VLLM_CPU_OMP_THREADS_BIND": "0-3"}) == {}  # vLLM's own setting, kept
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm_launch, "cuda_available", lambda: False)
    args, env = server_args(max_model_len=256)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("nobind", "1")
    monkeypatch.setattr(vllm_launch, "cuda_available", lambda: True)  # a GPU server: vLLM's own threads
    assert "OMP_NUM_THREADS" not in server_args(max_model_len=256)[1]


def test_a_launch_caches_prefixes_unless_the_user_says_otherwise():
    args, _ = server_args(max_model_len=256)
    assert args.count("--enable-prefix-caching") == 1
    args, _ = server_args(max_model_len=256, extra_args=["--no-enable-prefix-caching"])
    assert "--enable-prefix-caching" not in args and args[-1] == "--no-enable-prefix-caching"


def test_a_groups_samples_go_to_the_replica_that_holds_their_prompt():
    from trainer.generation.backend import SamplingParams
    from trainer.generation.vllm_backend import VllmBackend
    from trainer.generation.vllm_servers import VllmServers

    # No request is sent: each prompt is longer than max_len, so its turn is refused at
    # submit, after the sequence was assigned its replica.
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    servers = VllmServers(urls, max_concurrent=2)
    try:
        backend = VllmBackend(servers, model="m", stop_token_ids=[0], max_len=4)
        prompts = {"a-0": [1] * 8, "b-0": [2] * 8, "a-1": [1] * 8, "a-2": [1] * 8, "c-0": [3] * 8}
        for seq_id, ids in prompts.items():
            backend.submit(seq_id, ids, SamplingParams(max_new_tokens=4))
        where = {seq_id: seq.url for seq_id, seq in backend._seqs.items()}
        assert where["a-0"] == where["a-1"] == where["a-2"] == urls[0]
        # b goes to the least loaded replica, c too (3 sequences on the first, 1 on the second)
        assert where["b-0"] == where["c-0"] == urls[1]
        assert servers._load == {urls[0]: 3, urls[1]: 2}
        assert {t.finish_reason for t in backend.step()} == {"context"}
    finally:
        servers.close()
