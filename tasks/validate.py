"""Stage 1, validate_data: do the datasets mirror production traffic, and can they be used?

Each split (train, validation, test) runs the suite's GX Checkpoint (tasks/expectations.py),
which also refreshes the Data Docs site; the site goes to the stage's MLflow run as the
`data_docs` artifact. Then the checks no statistic makes (tasks/data_checks.py): leakage
between splits, gradability, row shapes, and the grader's reward-hacking probes on
validation items (trainer/graders/probe.py), built from what it reads and given the corpus
(`data.corpus_dir`) for the probes that paste a gold page. The report lists each failure
with the split, the expectation, the column, observed and expected values and sample rows,
and the stage stops the pipeline when there is any.

A suite check on a field the dataset does not have is skipped (listed as such) unless the
suite requires the field; distribution checks are skipped below `distribution_min_rows`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from tasks.cache import stage_cache
from tasks.data_checks import check_gradable, check_leakage, check_row_shapes, failure, short
from tasks.expectations import (
    DISTRIBUTION_EXPECTATIONS,
    LINE_COLUMN,
    THRESHOLDS,
    dataset_frame,
    gx_context,
    load_suite,
)
from tasks.results import ValidationResult
from tasks.tracking import (
    RunContext,
    link_split,
    log_datasets,
    log_json,
    log_metrics,
    log_text,
    publish_summary,
    stage_run,
)
from trainer.data import read_numbered, split_items, split_validation
from trainer.errors import DataError

STAGE = "validate_data"


@dataclass
class DatasetReport:
    """One split checked against the suite."""

    split: str
    path: str
    rows: int
    evaluated: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    kl_divergence: dict[str, float] = field(default_factory=dict)


def _gx_failure(split: str, path: str, outcome: Any) -> dict[str, Any]:
    """A failed GX ExpectationValidationResult, short: observed vs expected and sample rows."""
    config = outcome.expectation_config
    kwargs = {k: v for k, v in config.kwargs.items() if k not in ("column", "batch_id")}
    result = outcome.result or {}
    samples = [{"id": index.get("id"), "line": index.get(LINE_COLUMN)}
               for index in result.get("partial_unexpected_index_list") or []][: THRESHOLDS["sample_rows"]]
    if samples and result.get("partial_unexpected_list"):
        for sample, value in zip(samples, result["partial_unexpected_list"], strict=False):
            sample["value"] = short(value)
    if "unexpected_count" in result:
        observed: Any = f"{result['unexpected_count']} of {result.get('element_count')} rows"
    else:
        observed = result.get("observed_value")
    if config.type == "expect_column_kl_divergence_to_be_less_than":
        observed = {"kl_divergence": "inf" if observed is None else round(float(observed), 4)}
        kwargs = {"kl_divergence_at_most": kwargs["threshold"]}
    return failure(f"{split} ({path})", config.type, config.kwargs.get("column"), short(observed, 300),
                   short(kwargs, 300), result.get("unexpected_count"), samples)


def run_checkpoint(context: Any, suite: Any, split: str, path: Path, numbered: list) -> DatasetReport:
    """The suite's Checkpoint on one dataset, its results sorted into failures and skips."""
    report = DatasetReport(split=split, path=path.as_posix(), rows=len(numbered))
    frame = dataset_frame(numbered)
    required = {e.column for e in suite.expectations if e.expectation_type == "expect_column_to_exist"}
    checkpoint = context.checkpoints.get(suite.name)
    result = checkpoint.run(batch_parameters={"dataframe": frame})
    small = len(frame) < THRESHOLDS["distribution_min_rows"]
    for validation in result.run_results.values():
        for outcome in validation.results:
            kind, column = outcome.expectation_config.type, outcome.expectation_config.kwargs.get("column")
            if column is not None and column not in frame and column not in required:
                report.skipped.append({"expectation": kind, "column": column, "reason": "the dataset has no such field"})
                continue
            if kind in DISTRIBUTION_EXPECTATIONS and small:
                report.skipped.append({"expectation": kind, "column": column, "reason":
                                       f"{len(frame)} rows < distribution_min_rows {THRESHOLDS['distribution_min_rows']}"})
                continue
            report.evaluated += 1
            if kind == "expect_column_kl_divergence_to_be_less_than":
                value = (outcome.result or {}).get("observed_value")
                report.kl_divergence[column] = math.inf if value is None else float(value)
            if not outcome.success:
                report.failures.append(_gx_failure(split, report.path, outcome))
    return report


def split_files(data: Any) -> dict[str, tuple[Path, list[tuple[int, dict[str, Any]]]]]:
    """Each split's file and numbered rows (a job without a test file: both halves of its
    validation file)."""
    splits = {"train": Path(data.train_file), "validation": Path(data.validation_file)}
    if data.test_file:
        splits["test"] = Path(data.test_file)
    rows = {name: (path, read_numbered(path)) for name, path in splits.items()}
    for name, (path, numbered) in rows.items():
        if not numbered:
            raise DataError(f"{path}: the {name} file has no rows")
    if not data.test_file:
        path, numbered = rows["validation"]
        test_ids = {item["id"] for item in split_validation([{"id": n, **r} for n, r in numbered], "test")}
        rows["test"] = (path, [(n, r) for n, r in numbered if n in test_ids])
        rows["validation"] = (path, [(n, r) for n, r in numbered if n not in test_ids])
    return rows


@dataclass
class StageReport:
    suite: str
    datasets: list[DatasetReport]
    checks: list[dict[str, Any]]

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [f for d in self.datasets for f in d.failures] + self.checks

    def metrics(self) -> dict[str, float]:
        metrics = {"validate/failures": float(len(self.failures))}
        for d in self.datasets:
            metrics[f"validate/{d.split}_rows"] = float(d.rows)
            metrics[f"validate/{d.split}_failed_expectations"] = float(len(d.failures))
            for column, kl in sorted(d.kl_divergence.items()):
                metrics[f"validate/{d.split}_kl_{column}"] = kl
        return metrics

    def to_markdown(self) -> str:
        verdict = "passed" if not self.failures else f"FAILED ({len(self.failures)} failures)"
        lines = [f"# Data validation: {verdict}", "", f"Suite `{self.suite}`.", "",
                 "| split | file | rows | expectations run | failed | skipped |", "| --- | --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {d.split} | {d.path} | {d.rows} | {d.evaluated} | {len(d.failures)} | {len(d.skipped)} |"
                  for d in self.datasets]
        if self.failures:
            lines += ["", "## Failures", "", "| dataset | check | column | observed | expected | sample rows |",
                      "| --- | --- | --- | --- | --- | --- |"]
            for f in self.failures:
                cells = [f["dataset"], f"`{f['expectation']}`", f"`{f['column']}`", _cell(f["observed"]),
                         _cell(f["expected"]), "<br>".join(_cell(s) for s in f["samples"]) or "-"]
                lines.append("| " + " | ".join(cells) + " |")
        skipped = sorted({(s["column"], s["reason"]) for d in self.datasets for s in d.skipped})
        if skipped:
            lines += ["", "## Skipped", ""] + [f"- `{column}`: {reason}" for column, reason in skipped]
        return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text.replace("|", "\\|").replace("\n", " ")


def corpus_of(data: Any) -> Path | None:
    """The folder the items' `gold_pages` name (`data.corpus_dir`; auto: `corpus` beside the
    validation file)."""
    if data.corpus_dir is None:
        return None
    if data.corpus_dir == "auto":
        beside = Path(data.validation_file).parent / "corpus"
        return beside if beside.is_dir() else None
    corpus = Path(data.corpus_dir)
    if not corpus.is_dir():
        raise DataError(f"data.corpus_dir: {corpus} is not a folder; point it at the documents the items' "
                        "gold_pages name, or set it to null")
    return corpus


def probe_grader(data: Any, grader: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The reward-hacking probes on the first `data.probe_items` validation items, with the
    corpus: a failure per probe the grader pays beyond its plain content, one when its errors
    pass `data.probe_max_error_share`, and the probes' report (None when the config runs none)."""
    from trainer.graders.probe import THRESHOLD, run_probes

    if not data.probe_items:
        return [], None
    items = split_items(data, "validation", data.probe_items)
    report = run_probes(grader, items, corpus_dir=corpus_of(data), max_error_share=data.probe_max_error_share)
    failures = [failure(data.validation_file, "grader_pays_no_probe_beyond_its_plain_content",
                        f"probe {f['probe'].split('@')[0]}" + (f" in {f['place']}" if f["place"] != "output_text"
                                                                else ""),
                        f"item {f['item_id']!r}: scored {f['score']:.4g}, its plain content {f['plain_score']:.4g}",
                        f"at most {THRESHOLD} more than its plain content", 1, [short(f["answer"])])
                for f in report.flagged]
    if report.error_share > report.max_error_share:
        kinds = ", ".join(f"{kind} x{n}" for kind, n in sorted(report.grader_errors.items()))
        failures.append(failure(data.validation_file, "grader_grades_the_probes", "probes",
                                f"{report.errored} of {report.tried} probes were grader errors ({kinds})",
                                f"at most {report.max_error_share:.0%} (data.probe_max_error_share): past it the "
                                "probe check tested too little", report.errored, []))
    return failures, report.to_json() | {"summary": report.summary()}


def validate_datasets(data: Any, grader: dict[str, Any]) -> tuple[StageReport, Path | None]:
    """Every check of the stage on a config's datasets; returns the report and the Data
    Docs site (None without a suite)."""
    splits = split_files(data)
    checks = check_leakage(splits)
    for path, numbered in splits.values():
        checks += check_gradable(grader, numbered, path)
        checks += check_row_shapes(numbered, path)
    datasets, docs = [], None
    if data.expectations_suite:
        root = Path(data.expectations_dir)
        suite = load_suite(root, data.expectations_suite)
        context = gx_context(root)
        datasets = [run_checkpoint(context, suite, name, path, numbered) for name, (path, numbered) in splits.items()]
        docs = root / "uncommitted" / "data_docs" / "local_site"
    else:
        datasets = [DatasetReport(split=name, path=path.as_posix(), rows=len(numbered))
                    for name, (path, numbered) in splits.items()]
    return StageReport(suite=data.expectations_suite or "(no suite)", datasets=datasets, checks=checks), docs


@task(name=STAGE, persist_result=True, cache_policy=stage_cache(__name__))
def validate_data(data: Any, grader: dict[str, Any], ctx: RunContext) -> ValidationResult | Any:
    """The suite's Checkpoint on every split, then leakage, gradability and shape checks.
    Data that fails them (or cannot be read) is a verdict, not a crash: the task ends in a
    failed state named "Stopped" whose message is the report's line (no traceback, and
    nothing cached), which the pipeline ends on as it does on a gate."""
    from prefect.states import Failed

    try:
        return _validate_data(data, grader, ctx)
    except DataError as exc:
        return Failed(name="Stopped", message=str(exc))


def _validate_data(data: Any, grader: dict[str, Any], ctx: RunContext) -> ValidationResult:
    with stage_run(ctx, STAGE, {"data": data, "grader": grader}) as (client, run_id):
        report, docs = validate_datasets(data, grader)
        paid, probes = probe_grader(data, grader)
        report.checks += paid
        if probes is not None:
            log_json(client, run_id, probes, "grader_probes.json")
            log_metrics(client, run_id, {"validate/probes_paid": float(len(probes["flagged"])),
                                         "validate/probes_tried": float(probes["tried"]),
                                         "validate/probes_errored": float(probes["errored"]),
                                         "validate/probe_families_untested": float(len(probes["untested"]))})
            if probes["untested"] or not probes["reads_known"]:
                get_run_logger().warning("validate_data: the grader probes %s", probes["summary"])
        files = {"train": Path(data.train_file), "validation": Path(data.validation_file)}
        if data.test_file:
            files["test"] = Path(data.test_file)
        log_datasets(ctx, run_id, files)
        log_metrics(client, run_id, report.metrics())
        markdown = report.to_markdown()
        if probes is not None:
            markdown += f"\n## Grader probes\n\n{probes['summary'][0].upper()}{probes['summary'][1:]}.\n"
        log_text(client, run_id, markdown, "validation_report.md")
        log_json(client, run_id, {"suite": report.suite, "failures": report.failures,
                                  "datasets": [d.__dict__ for d in report.datasets]}, "validation_report.json")
        if docs is not None and docs.is_dir():
            client.log_artifacts(run_id, str(docs), "data_docs")
        publish_summary(ctx, STAGE, run_id, markdown)
        if report.failures:
            first = report.failures[0]
            raise DataError(
                f"validate_data: {len(report.failures)} failed checks; first: `{first['expectation']}` on "
                f"`{first['column']}` of {first['dataset']}: observed {short(first['observed'])}, expected "
                f"{short(first['expected'])}. Full report: validation_report.md in MLflow run {run_id}"
            )
    for split in ("validation", "test"):  # the splits the stages read, as MLflow evaluation datasets
        link_split(ctx, run_id, data, split)
    source = "test file" if data.test_file else "seeded half of the validation file (no test_file)"
    return ValidationResult(run_id=run_id, metrics=report.metrics(), test_split=source)
