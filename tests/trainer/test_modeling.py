"""Loading the policy model: several threads of one process may load at once.

Two pipeline runs in one process (a scheduled run and one from the UI, both in Prefect task
threads) load the base model at the same moment; transformers' loader flips process-wide
switches while it builds a model, and without `load_model_and_tokenizer` taking turns most
such loads failed ("Cannot copy out of meta tensor") or came back with untied weights.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from envs.finqa.demo_model import MODEL_DIR
from trainer.generation.modeling import load_model_and_tokenizer


def test_threads_loading_at_once_each_get_the_saved_weights():
    reference, _ = load_model_and_tokenizer(str(MODEL_DIR), device="cpu")
    expected = {name: tensor.clone() for name, tensor in reference.state_dict().items()}
    for _ in range(3):
        barrier = threading.Barrier(4)

        def load(_, barrier=barrier):
            barrier.wait()  # all four start together
            model, _tokenizer = load_model_and_tokenizer(str(MODEL_DIR), device="cpu")
            return model

        with ThreadPoolExecutor(4) as pool:
            models = list(pool.map(load, range(4)))
        for model in models:
            state = model.state_dict()
            assert state.keys() == expected.keys()
            assert all(torch.equal(state[name], tensor) for name, tensor in expected.items())
            # the shipped model ties its head to its embeddings; a concurrent load left them apart
            assert model.config.tie_word_embeddings
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
