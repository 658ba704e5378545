"""What the FinQA-style demo environment needs before a run, on one machine.

The demo is one environment among others: the generic pipeline runs on its own config
(`envs/finqa/demo.yaml`) exactly as a user runs theirs. The runner (`flows/demo.py`, what
`make demo` starts) adds what a user would do by hand before `agentrft run`:

1. the data: regenerated from its seed when `data/` is missing or differs, then checked
   against `data.dvc` by DVC itself;
2. the base model: the shipped `envs/finqa/model/`, checked against its pin
   (`envs/finqa/model.pin.json`); `agentrft model bootstrap` rebuilds it;
3. the tools: the FinQA tool server, started on loopback at the port the config's
   endpoints name, and stopped at the end.

Then it prints the before/after table, the decision, the main figures and the commands
that open the UIs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from trainer.errors import AgentRFTError, ConfigError

DEMO_CONFIG = Path(__file__).resolve().parent / "demo.yaml"


def ensure_data(config: Any, *, seed: int = 0, log: Any = print) -> str:
    """The demo data in place and exactly what `data.dvc` pins; returns the md5."""
    from envs.finqa.generate import generate_dataset
    from tasks.data_version import ensure_pinned

    return ensure_pinned(config.data.dvc_file, Path(config.data.train_file).parent, generate_dataset, seed=seed,
                         source="envs/finqa/generate.py", log=log)


def corpus_for(split_file: str | Path) -> Path:
    """The corpus a split's questions are asked of: the nearest `corpus/` folder beside the
    split's file or above it (the new companies' split has its own; the others share
    `data/corpus`)."""
    folder = Path(split_file).resolve().parent
    for candidate in (folder, *folder.parents):
        if (candidate / "corpus").is_dir():
            return candidate / "corpus"
    raise ConfigError(f"{split_file}: no corpus/ folder beside it or above it; regenerate the demo data "
                      "(`agentrft data verify`)")


@contextmanager
def tool_server(config: Any, corpus_dir: Path, *, api_key: str | None = None) -> Iterator[str]:
    """The FinQA tool server on the loopback port the config's endpoints name."""
    from envs.finqa.server import create_app
    from envs.tool_server import serve_in_thread

    urls = {urlparse(e.server_url) for e in config.tools.endpoints}
    ports = {(u.hostname, u.port) for u in urls}
    if len(ports) != 1:
        raise ConfigError(f"{DEMO_CONFIG}: the demo serves every tool from one server; the endpoints name {ports}")
    host, port = ports.pop()
    if host not in ("127.0.0.1", "localhost"):
        raise ConfigError(f"the demo tool server binds to loopback; the endpoints name host {host}")
    app = create_app(corpus_dir, max_output_chars=config.tools.max_output_chars, api_key=api_key)
    try:
        with serve_in_thread(app, port=port or 80) as base_url:
            yield base_url
    except OSError as exc:
        raise AgentRFTError(f"cannot start the demo tool server on {host}:{port} ({exc.strerror}); stop whatever "
                            "uses that port or change the port of tools.endpoints in the config") from None
