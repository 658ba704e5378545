"""The `agentrft` command line as a user runs it: the installed console script in real
subprocesses, exit codes, clear one-line errors instead of tracebacks, and every command
the README tells a user about run for real on the micro world (`eval`, `serve-model`,
`model bootstrap`, `ui`, `data import-finqa`, `config validate`, `expectations derive`,
`run` with `--set` overrides)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import yaml

from envs.finqa.demo import DEMO_CONFIG
from envs.finqa.demo_model import PIN_FILE
from envs.finqa.generate import TICKERS
from envs.finqa.tiny_model import count_parameters
from tasks.expectations import load_suite
from tasks.tracking import mlflow_client
from tests.pipeline_world import micro
from tests.taught_model import GRADER as ANSWER_GRADER
from tests.taught_model import SYSTEM, TOOLS
from trainer.config.loading import load_config
from trainer.data import read_items, read_jsonl
from trainer.generation.modeling import load_model_and_tokenizer

REPO = Path(__file__).resolve().parents[2]
AGENTRFT = Path(sys.executable).parent / "agentrft"  # the console script pyproject installs
GRADER = REPO / "envs" / "finqa" / "grader.json"


def agentrft(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(AGENTRFT), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@contextmanager
def started(*args: str, log: Path, env: dict[str, str] | None = None,
            stop: str = "ctrl-c") -> Iterator[subprocess.Popen]:
    """`agentrft ARGS` running in its own process group, its output in `log`; at the end
    Ctrl-C (SIGINT to the group), as a user stops it in a terminal, or (`stop="kill"`)
    SIGTERM to the process alone, as `kill PID` or a service manager stops it; the group is
    killed if it does not stop."""
    with log.open("w") as output:
        process = subprocess.Popen([str(AGENTRFT), *args], cwd=REPO, env={**os.environ, **(env or {})},
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    process.log = log
    try:
        yield process
    finally:
        if process.poll() is None:
            if stop == "kill":
                process.send_signal(signal.SIGTERM)
            else:
                os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def wait_until_answers(url: str, process: subprocess.Popen, timeout: float = 240) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{process.args} exited with {process.returncode}: {process.log.read_text()[-3000:]}")
        try:
            response = httpx.get(url, timeout=5)
            if response.status_code == 200:
                return response
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} did not answer within {timeout:.0f} s")


def write_config(path: Path, config) -> Path:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


@pytest.fixture(scope="module")
def micro_yaml(world, endpoints, taught_model, tmp_path_factory) -> Path:
    """The micro pipeline config on the taught model, as a YAML file a user would write."""
    return write_config(tmp_path_factory.mktemp("cli") / "micro.yaml", micro(world, endpoints, taught_model))


# --- help, errors, exit codes ---------------------------------------------------------------


def test_help_lists_every_command() -> None:
    result = agentrft("--help")
    assert result.returncode == 0, result.stderr
    for command in ("run", "demo", "train", "eval", "promote", "serve", "deploy", "api", "ui", "serve-model", "data",
                    "env", "grader", "config", "model", "expectations"):
        assert re.search(rf"│ {re.escape(command)} ", result.stdout), command
    result = agentrft("run", "--help")
    assert result.returncode == 0 and "--set" in result.stdout and "--refresh" in result.stdout


def test_grader_validate_and_run(tmp_path: Path, demo_data_dir: Path) -> None:
    result = agentrft("grader", "validate", "--grader", str(GRADER))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"grader": str(GRADER), "valid": True}

    item = json.loads((demo_data_dir / "validation.jsonl").read_text().splitlines()[0])
    item_file = tmp_path / "item.json"
    item_file.write_text(json.dumps(item))
    result = agentrft(
        "grader", "run", "--grader", str(GRADER), "--item", str(item_file),
        "--sample", f"Answer: {item['reference_answer']}",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["reward"] == 1.0
    result = agentrft("grader", "run", "--grader", str(GRADER), "--item", str(item_file), "--sample", "no idea")
    assert result.returncode == 0 and json.loads(result.stdout)["reward"] == 0.0
    # A reference the grader cannot read is a grader error, not a score: exit status 1.
    item_file.write_text(json.dumps({**item, "reference_answer": "2019: 3.5"}))
    result = agentrft("grader", "run", "--grader", str(GRADER), "--item", str(item_file), "--sample", "Answer: 3")
    assert json.loads(result.stdout)["reward"] is None
    assert result.returncode == 1


@pytest.mark.parametrize(
    ("args", "content", "expected"),
    [
        (["grader", "validate", "--grader"], b'{"type": "string_check", "operation": "equals"}', "operation"),
        (["grader", "validate", "--grader"], b"{not json", "line 1"),
        (["grader", "validate", "--grader"], b"\xff\xfe", "UTF-8"),
        (["config", "validate"], b"training:\n  n_epochs: [\n", "invalid YAML"),
        (["config", "validate"], b"trainig: {}\n", "trainig: unknown key"),
        (["config", "validate"], b"name: job\n", "model: required key is missing"),
    ],
)
def test_bad_input_is_a_clear_error_without_traceback(
    tmp_path: Path, args: list[str], content: bytes, expected: str
) -> None:
    path = tmp_path / "input.file"
    path.write_bytes(content)
    result = agentrft(*args, str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert expected in result.stderr
    assert str(path) in result.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["data", "verify", "--data-dir", "data"], "No such option: --data-dir"),
        (["eval", "--k", "many"], "Invalid value for '--k'"),
        (["config", "validate"], "Missing argument 'config'"),
    ],
)
def test_usage_errors_are_one_message_without_traceback(args: list[str], expected: str) -> None:
    result = agentrft(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert expected in result.stderr


def test_missing_header_secret_is_named(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        "model: {base_model: some/model}\n"
        "grader: {type: numeric, name: n, input: '{{sample.output_text}}', reference: '{{item.answer}}'}\n"
        "tools:\n  endpoints:\n    - name: search\n      server_url: http://127.0.0.1:1/s\n"
        "      headers: {Authorization: 'Bearer ${AGENTRFT_TEST_TOKEN}'}\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "AGENTRFT_TEST_TOKEN"}
    result = subprocess.run([str(AGENTRFT), "config", "validate", str(config)], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "AGENTRFT_TEST_TOKEN (tools.endpoints[0].headers.Authorization)" in result.stderr
    assert "Traceback" not in result.stderr
    result = agentrft("config", "validate", str(config), env={"AGENTRFT_TEST_TOKEN": "t0ken"})
    assert result.returncode == 0 and "t0ken" not in result.stdout


def test_config_validate_with_set_overrides() -> None:
    result = agentrft("config", "validate", str(DEMO_CONFIG), "--set", "training.max_steps=2",
                      "--set", "promotion.group_by=ticker")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    overridden = load_config(DEMO_CONFIG, {"training": {"max_steps": 2}, "promotion": {"group_by": "ticker"}})
    assert shown == {"config": str(DEMO_CONFIG), "valid": True, "hash": overridden.section_hash(),
                     # the shipped demo model's template is Qwen2.5's Hermes format
                     "chat_format": "qwen2.5", "chat_format_setting": "auto",
                     "stop_tokens": ["<|endoftext|>", "<|im_end|>"]}
    assert shown["hash"] != load_config(DEMO_CONFIG).section_hash()
    result = agentrft("config", "validate", str(DEMO_CONFIG), "--set", "training.max_step=2")
    assert result.returncode == 2 and "training.max_step: unknown key" in result.stderr


# --- the demo's data ------------------------------------------------------------------------


def demo_config_in(root: Path, dvc_text: str) -> Path:
    """The demo config with its data under `root`, a DVC project whose data.dvc is `dvc_text`."""
    from tasks.data_version import init

    init(root)
    (root / "data.dvc").write_text(dvc_text)
    data = root / "data"
    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    raw["data"].update(dvc_file=str(root / "data.dvc"), train_file=str(data / "train.jsonl"),
                       validation_file=str(data / "validation.jsonl"), test_file=str(data / "test.jsonl"),
                       production_traffic_file=str(data / "production_traffic.jsonl"))
    path = root / "demo.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_data_verify_regenerates_the_pinned_data(tmp_path: Path) -> None:
    config = demo_config_in(tmp_path, (REPO / "data.dvc").read_text())
    pin = yaml.safe_load((REPO / "data.dvc").read_text())["outs"][0]["md5"].removesuffix(".dir")
    result = agentrft("data", "verify", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert f"regenerating {tmp_path / 'data'} from seed 0" in result.stdout
    assert result.stdout.strip().endswith(f"data matches its DVC pin (md5 {pin})")
    assert len(read_jsonl(tmp_path / "data" / "test.jsonl")) == 250


def test_data_verify_reports_a_mismatch(tmp_path: Path) -> None:
    other = "outs:\n- md5: 00000000000000000000000000000000.dir\n  size: 1\n  nfiles: 1\n  hash: md5\n  path: data\n"
    config = demo_config_in(tmp_path, other)
    result = agentrft("data", "verify", "--config", str(config))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"error: the regenerated data does not match {tmp_path / 'data.dvc'}")
    assert "no longer reproduces the pinned data" in error[0]


FINQA_RECORDS = [
    {"pre_text": ["revenue grew ."], "post_text": [], "filename": "ADI/2009/page_49.pdf",
     "table": [["", "2009", "2008"], ["net revenue", "$ 2,603", "$ 2,583"]], "id": "ADI/2009/page_49.pdf-1",
     "qa": {"question": "what is the percentage change in net revenue from 2008 to 2009?",
            "program": "subtract(2603, 2583), divide(#0, 2583)", "exe_ans": 0.00774, "answer": "0.8%"}},
    {"pre_text": [], "post_text": [], "filename": "BRK/B/2015/page_7.pdf", "table": [["cash", "120"], ["debt", "60"]],
     "id": "BRK/B/2015/page_7.pdf-3",
     "qa": {"question": "what is the ratio of cash to debt?", "program": "divide(120, 60)", "exe_ans": 2.0}},
]  # fmt: skip


def test_data_import_finqa(tmp_path: Path) -> None:
    source = tmp_path / "dev.json"
    source.write_text(json.dumps(FINQA_RECORDS))
    out = tmp_path / "finqa"
    result = agentrft("data", "import-finqa", str(source), "--out", str(out), "--split", "dev")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote 2 items to {out / 'dev.jsonl'}"
    rows = read_jsonl(out / "dev.jsonl")
    assert [(r["id"], r["reference_answer"], r["gold_pages"]) for r in rows] == [
        ("ADI/2009/page_49.pdf-1", "0.8%", ["reports/ADI/2009/page_49.txt"]),
        ("BRK/B/2015/page_7.pdf-3", "2", ["reports/BRK.B/2015/page_7.txt"]),
    ]
    assert (out / "corpus/reports/BRK.B/2015/page_7.txt").read_text() == "cash | 120\ndebt | 60\n"
    result = agentrft("data", "import-finqa", str(tmp_path / "missing.json"), "--out", str(out))
    assert result.returncode == 2 and "missing.json" in result.stderr and "Traceback" not in result.stderr


# --- expectations ---------------------------------------------------------------------------


def test_expectations_derive_from_traffic(demo_data_dir: Path, world: Path, endpoints, tmp_path: Path) -> None:
    # The job's grader and tools decide what is required; the model is not read.
    job = write_config(tmp_path / "micro.yaml", micro(world, endpoints, tmp_path / "no-model"))
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(line + "\n" for line in
                               (demo_data_dir / "production_traffic.jsonl").read_text().splitlines()[:300]))
    context = tmp_path / "gx"
    result = agentrft("expectations", "derive", "--from", str(traffic), "--config", str(job),
                      "--dir", str(context), "--name", "derived")
    assert result.returncode == 0, result.stderr
    suite_file = context / "expectations" / "derived.json"
    assert result.stdout.strip() == f"wrote {suite_file} (and its checkpoint in {context})"
    suite = json.loads(suite_file.read_text())
    assert suite["meta"]["derived_from"]["rows"] == 300
    required = {e["kwargs"]["column"] for e in suite["expectations"]
                if e["type"] == "expect_column_values_to_not_be_null"}
    # messages, plus what the micro job's grader reads (its tool schemas are in the config)
    assert required == {"messages", "reference_answer"}
    categories = next(e for e in suite["expectations"]
                      if e["type"] == "expect_column_values_to_be_in_set" and e["kwargs"]["column"] == "category")
    assert categories["kwargs"]["value_set"] == ["change", "multi_year", "percent_change", "ratio", "single_lookup"]
    assert (context / "checkpoints" / "derived.json").is_file()
    assert load_suite(context, "derived").name == "derived"


# --- evaluation and serving on the taught model ---------------------------------------------


@pytest.mark.integration
def test_eval_on_the_taught_model(world: Path, micro_yaml: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    result = agentrft("eval", "--config", str(micro_yaml), "--k", "1", "--max-items", "2",
                      "--set", "promotion.group_by=ticker", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stderr
    items = read_items(world / "data" / "validation.jsonl", 2)
    rollouts = read_jsonl(out / "rollouts.jsonl")
    assert sorted(r["item_id"] for r in rollouts) == sorted(i["id"] for i in items)  # 2 items x k=1
    summary = json.loads((out / "summary.json").read_text())
    scores = [r["score"] for r in rollouts if r["score"] is not None]
    assert scores and summary["metrics"]["eval/score_mean"] == pytest.approx(sum(scores) / len(scores))
    assert summary["metrics"]["eval/rollouts"] == 2.0
    assert sum(summary["status_counts"].values()) == 2
    assert set(summary["group_means"]) == {i["ticker"] for i in items}  # --set promotion.group_by=ticker
    assert all(f"ticker: {i['ticker']}" in result.stdout for i in items)
    for name in ("items.jsonl", "per_item_spread.png", "tool_calls_hist.png"):
        assert (out / name).stat().st_size > 0


@pytest.mark.integration
def test_serve_model_answers_the_openai_client(world: Path, taught_model: Path, tmp_path: Path) -> None:
    port = free_port()
    traces_store = f"sqlite:///{tmp_path / 'served.db'}"
    with started("serve-model", "--model", str(taught_model), "--port", str(port), "--device", "cpu",
                 "--max-len", "1024", "--trace-to", traces_store, log=tmp_path / "serve-model.log") as server:
        models = wait_until_answers(f"http://127.0.0.1:{port}/v1/models", server).json()
        assert [m["id"] for m in models["data"]] == [str(taught_model)]
        assert listening_addresses(port) == {"127.0.0.1"}
        item = read_items(world / "data" / "validation.jsonl", 1)[0]
        messages = [{"role": "system", "content": SYSTEM}, *item["messages"]]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        replies = [client.chat.completions.create(model=str(taught_model), messages=messages, tools=TOOLS,
                                                  temperature=0, max_tokens=48) for _ in range(2)]
        first = replies[0].choices[0]
        assert replies[0].model == str(taught_model)
        assert first.message.model_dump() == replies[1].choices[0].message.model_dump()  # greedy: the same twice
        if first.finish_reason == "tool_calls":
            call = first.message.tool_calls[0].function
            assert call.name in ("list", "cat") and "path" in json.loads(call.arguments)
        else:
            assert first.finish_reason == "stop" and first.message.content.startswith("Answer:")
        _, tokenizer = load_model_and_tokenizer(str(taught_model), device="cpu")
        prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert replies[0].usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert 0 < replies[0].usage.completion_tokens <= 48
    assert server.returncode is not None and listening_addresses(port) == set()

    # --trace-to: each request is a trace, which the grader's MLflow scorer scores as the
    # pipeline grades (against the item, logged as the expectation a labeller would add)
    import mlflow

    from tasks.scoring import grader_scorer
    from trainer.graders import grade, sample_from_text

    mlflow.set_tracking_uri(traces_store)
    experiment = mlflow.get_experiment_by_name("agentrft-served").experiment_id
    traces = mlflow.search_traces(experiment_ids=[experiment])
    assert len(traces) == 2
    for trace_id in traces["trace_id"]:
        trace = mlflow.get_trace(trace_id)
        assert trace.info.tags["kind"] == "served" and trace.info.tags["model"] == str(taught_model)
        assert [s.span_type for s in trace.data.spans] == ["AGENT", "CHAT_MODEL"]
        mlflow.log_expectation(trace_id=trace_id, name="item", value={"reference_answer": item["reference_answer"]})
    traces = mlflow.search_traces(experiment_ids=[experiment])
    mlflow.set_experiment(experiment_id=experiment)  # the evaluation run beside the traces it scores
    mlflow.genai.evaluate(data=traces, scorers=[grader_scorer(ANSWER_GRADER, name="answer")])
    reply = first.message.model_dump()
    expected = grade(ANSWER_GRADER, sample_from_text(reply["content"] or "", reply.get("tool_calls") or []),
                     {"reference_answer": item["reference_answer"]})
    for trace_id in traces["trace_id"]:
        [scored] = [a for a in mlflow.get_trace(trace_id).info.assessments if a.name == "answer"]
        assert scored.value == expected.reward and (scored.error is None) == (expected.reward is not None)


# --- the demo model and the UIs -------------------------------------------------------------


@pytest.mark.integration
def test_model_bootstrap_with_a_tiny_budget(world: Path, tmp_path: Path) -> None:
    pin_before = PIN_FILE.read_bytes() if PIN_FILE.exists() else None
    out = tmp_path / "model"
    result = agentrft("model", "bootstrap", "--out", str(out), "--tokens", "3072", "--data-dir",
                      str(world / "data"), "--seed", "0", "--no-pin", timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(out)
    record = json.loads((out / "bootstrap.json").read_text())
    assert record["settings"]["train_tokens"] == 3072 and record["settings"]["seed"] == 0
    assert 1 <= record["demonstrations"] <= 2 * 2  # two training items, two demonstrations each
    model, tokenizer = load_model_and_tokenizer(str(out), device="cpu")
    assert count_parameters(model) == record["parameters"]
    # the tokenizer the build trained: tickers spelled one character a token, a chat template
    assert tokenizer.chat_template and len(tokenizer(TICKERS[0], add_special_tokens=False)["input_ids"]) == len(TICKERS[0])
    assert (PIN_FILE.read_bytes() if PIN_FILE.exists() else None) == pin_before  # --no-pin


@pytest.mark.integration
def test_ui_serves_prefect_and_mlflow_on_loopback_and_frees_both_ports_on_sigterm(tmp_path: Path) -> None:
    """Stopped by SIGTERM to its own process only (`kill PID`, a service manager), `agentrft
    ui` stops both servers and every worker they started: both ports are free again."""
    prefect_port, mlflow_port = free_port(), free_port()
    store = tmp_path / "mlflow.db"
    with started("ui", "--tracking-uri", f"sqlite:///{store}", "--prefect-port", str(prefect_port),
                 "--mlflow-port", str(mlflow_port), log=tmp_path / "ui.log",
                 env={"PREFECT_HOME": str(tmp_path / "prefect")}, stop="kill") as ui:
        assert wait_until_answers(f"http://127.0.0.1:{prefect_port}/api/health", ui).json() is True
        assert wait_until_answers(f"http://127.0.0.1:{mlflow_port}/health", ui).text == "OK"
        experiments = httpx.get(f"http://127.0.0.1:{mlflow_port}/api/2.0/mlflow/experiments/search",
                                params={"max_results": 10}).json()["experiments"]
        assert [e["name"] for e in experiments] == ["Default"] and store.is_file()  # the store it was given
        assert listening_addresses(prefect_port) == {"127.0.0.1"}
        assert listening_addresses(mlflow_port) == {"127.0.0.1"}
    assert ui.returncode == 0, ui.log.read_text()[-3000:]
    assert listening_addresses(prefect_port) == listening_addresses(mlflow_port) == set()


# --- the pipeline with --set overrides ------------------------------------------------------


@pytest.mark.integration
def test_run_with_set_overrides(harness, micro_yaml: Path, tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    store = tmp_path / "mlflow.db"
    # A headroom gate no model can pass stops the run after the baseline; the gate's text and
    # the logged params show that every override reached the run.
    result = agentrft("run", "--config", str(micro_yaml), "--set", "baseline.min_headroom=1.0",
                      "--set", "baseline.k=3", "--set", f"mlflow.tracking_uri=sqlite:///{store}",
                      "--set", f"work_dir={tmp_path / 'runs'}", env={"PREFECT_API_URL": PREFECT_API_URL.value(),
                                                                   "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "results")},
                      timeout=600)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    assert re.search(r"^error: .*baseline gate failed: best-of-3 is only [0-9.]+ above the mean score \(gate: 1\.0\)",
                     result.stderr, re.M), result.stderr
    client = mlflow_client(f"sqlite:///{store}")
    (parent,) = client.search_runs(client.get_experiment_by_name("micro").experiment_id,
                                   filter_string="tags.stage = 'pipeline'")
    assert parent.info.status == "FAILED"
    assert (parent.data.tags["outcome"], parent.data.tags["stopped_at"]) == ("stopped", "baseline")
    assert (parent.data.params["baseline.k"], parent.data.params["baseline.min_headroom"]) == ("3", "1.0")
    assert (tmp_path / "runs" / "baseline").is_dir()
