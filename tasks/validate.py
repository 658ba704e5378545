"""Data validation: do the training and evaluation sets mirror production traffic?

RFT learns the distribution it is trained on, so the first stage checks the datasets
against what production actually sends, before any GPU time is spent. Three checks:

1. A Great Expectations (1.x) suite *derived from the production traffic log*
   (`derive_suite`): every field the traffic has exists, required fields are never null,
   values keep the types traffic uses, ids are unique, categories stay in traffic's set,
   the question-length quantiles stay in traffic's ranges, and the category mix and the
   binned question-length distribution stay within a KL-divergence threshold of traffic's.
   GX dropped its profilers in 1.x, so the derivation is this module's code; the suite is
   plain GX JSON (`expectations/production_traffic.json`), reviewed and committed like code.
2. Leakage: no id and no normalised question is shared between train and eval, or the
   evaluation measures memory instead of skill.
3. Every reference answer works with the configured grader: a reference the grader cannot
   parse would turn every rollout of that item into a grader error. Likewise every row must
   be one a rollout can start from (well-formed messages, valid own tool schemas, small
   enough for a tool request): the tool client would refuse it mid-training.

`validate_splits` runs all three and returns a `StageReport` whose failures name the
expectation, the column, the observed and expected values and sample rows (id, line,
value): the report the pipeline shows when it stops at this stage.

The suite's `meta.thresholds` holds the knobs it was derived with; `notes` explains them.
Distribution checks (KL, quantiles) need enough rows to mean anything: a dataset smaller
than `distribution_min_rows` skips them, and the report lists them as skipped.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from prefect import task

from envs.finqa.generate import normalize_question
from tasks.tracking import (
    RunContext,
    log_datasets,
    log_json,
    log_metrics,
    log_text,
    publish_summary,
    stage_run,
)
from trainer.config import PipelineConfig
from trainer.errors import DataError
from trainer.graders import grade, sample_from_text, validate_grader
from trainer.graders.result import GraderError
from trainer.graders.templates import lookup_variable, template_variables
from trainer.tools import tool_validators

# Fields only production has: the datasets are not expected to carry them.
PRODUCTION_ONLY_FIELDS = ("timestamp",)
# Fields the pipeline reads from every item, required whatever the traffic log holds.
REQUIRED_FIELDS = ("id", "messages", "question", "reference_answer", "category")
# The column added to every frame: the row's line in its JSONL file, so samples can be found.
LINE_COLUMN = "_line"
DERIVED_COLUMNS = {"question_length": "number of characters of `question`"}

THRESHOLDS: dict[str, Any] = {
    "kl_max_category": 0.1,
    "kl_max_question_length": 0.15,
    "kl_tail_weight_holdout": 0.01,
    "question_length_bins": 10,
    "quantiles": [0.05, 0.25, 0.5, 0.75, 0.95],
    "quantile_probability_band": 0.05,
    "quantile_relative_tolerance": 0.1,
    "distribution_min_rows": 200,
    "sample_rows": 5,
}
THRESHOLD_NOTES = {
    "kl_max_category": "Largest KL divergence of a dataset's category mix from traffic's. "
    "Sampling noise at 200 rows stays below 0.05 (99.9 %); a mix shifted as far as "
    "30/20/20/15/15 -> 5/5/10/35/45 scores about 0.56.",
    "kl_max_question_length": "Largest KL divergence of the binned question length from "
    "traffic's. It includes a constant -ln(1 - kl_tail_weight_holdout) = 0.01 from the "
    "holdout; on the demo data, random 200-row samples of the splits stay below 0.1 "
    "(99.9 % of 5000 draws), and questions all longer than traffic's longest score 5.3.",
    "kl_tail_weight_holdout": "Weight given to lengths or categories outside traffic's range "
    "or set, so that one unseen value raises the divergence instead of making it infinite.",
    "question_length_bins": "Bins of the question-length partition, cut at traffic's quantiles "
    "(fewer when quantiles tie).",
    "quantiles": "Question-length quantiles checked.",
    "quantile_probability_band": "Each quantile q may lie between traffic's quantiles q-band and "
    "q+band (sampling noise of a quantile at 200 rows is about 0.015)...",
    "quantile_relative_tolerance": "...widened by this fraction of those values.",
    "distribution_min_rows": "Datasets with fewer rows skip the KL and quantile checks: "
    "their sampling noise would exceed any useful threshold.",
    "sample_rows": "Sample rows listed per failure.",
}
DISTRIBUTION_EXPECTATIONS = (
    "expect_column_kl_divergence_to_be_less_than",
    "expect_column_quantile_values_to_be_between",
)
# Graders that parse their reference and can reject it (the numeric grader's
# reference_parse_error). Every other grader type gets its `{{item.*}}` variables checked
# per row instead of being run: judges and endpoints would cost a request per row.
REFERENCE_PARSING_GRADERS = ("numeric",)
# Every tool request carries the whole row (`item`) and is capped at 1 MB (OpenAI's limit,
# the tool client's max_body_bytes); 64 kB stay free for the call's arguments and envelope.
MAX_ROW_BYTES = 1_000_000 - 64 * 1024


# --- reading --------------------------------------------------------------------------


def read_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The rows of a JSONL file with their 1-based line numbers; blank lines are skipped.
    Raises DataError naming the file and line for a missing file, invalid UTF-8, invalid
    JSON, a line that is not an object, or a file with no rows."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror}); check the path") from None
    rows = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{path}:{number}: invalid UTF-8 at byte {exc.start} of the line; "
                "re-encode the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}:{number}: invalid JSON ({exc.msg} at column {exc.colno}); "
                "each line must be one JSON object"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append((number, row))
    if not rows:
        raise DataError(f"{path}: the file has no rows")
    return rows


def load_suite(path: Path) -> dict[str, Any]:
    """A suite JSON written by `write_suite`; DataError when it is missing or invalid."""
    path = Path(path)
    try:
        suite = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(
            f"{path}: no expectation suite; derive one with "
            "`agentrft expectations derive --from <production traffic>`"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a readable suite JSON ({exc})") from None
    if not isinstance(suite, dict) or not isinstance(suite.get("expectations"), list):
        raise DataError(f"{path}: not a Great Expectations suite (no `expectations` list)")
    return suite


# --- deriving the suite from production traffic ------------------------------------------


def derive_suite(traffic_path: Path, *, name: str = "production_traffic") -> dict[str, Any]:
    """A GX expectation suite (its JSON dict) describing the production traffic log."""
    traffic_path = Path(traffic_path)
    rows = [row for _, row in read_rows(traffic_path)]
    fields = list(dict.fromkeys(key for row in rows for key in row))
    fields = [f for f in fields if f not in PRODUCTION_ONLY_FIELDS]
    for needed in ("id", "question", "category"):
        if not any(isinstance(row.get(needed), str) for row in rows):
            raise DataError(
                f"{traffic_path}: no row has a string {needed!r}; the suite is derived from it"
            )
    always_present = [f for f in fields if all(row.get(f) is not None for row in rows)]
    required = [f for f in fields if f in REQUIRED_FIELDS or f in always_present]
    required += [f for f in REQUIRED_FIELDS if f not in required]
    t = THRESHOLDS

    expectations: list[dict[str, Any]] = []

    def expect(kind: str, why: str, **kwargs: Any) -> None:
        expectations.append({"type": kind, "kwargs": kwargs, "meta": {"why": why}})

    for column in required:
        expect("expect_column_to_exist", "the field is part of every item", column=column)
    for column in required:
        expect(
            "expect_column_values_to_not_be_null", "the field is set in every item", column=column
        )
    for column in fields:
        types = sorted({type(row[column]).__name__ for row in rows if row.get(column) is not None})
        why = "values keep the JSON types production traffic uses"
        if len(types) == 1:
            expect("expect_column_values_to_be_of_type", why, column=column, type_=types[0])
        elif types:
            expect("expect_column_values_to_be_in_type_list", why, column=column, type_list=types)
    expect("expect_column_values_to_be_unique", "items are told apart by id", column="id")

    categories = [row["category"] for row in rows if isinstance(row.get("category"), str)]
    values, counts = np.unique(categories, return_counts=True)
    expect(
        "expect_column_values_to_be_in_set",
        "only categories production traffic has",
        column="category",
        value_set=[str(v) for v in values],
    )
    expect(
        "expect_column_kl_divergence_to_be_less_than",
        "the category mix mirrors production traffic",
        column="category",
        partition_object={
            "values": [str(v) for v in values],
            "weights": [int(c) / len(categories) for c in counts],
        },
        threshold=t["kl_max_category"],
        tail_weight_holdout=t["kl_tail_weight_holdout"],
    )

    lengths = np.array(
        [len(row["question"]) for row in rows if isinstance(row.get("question"), str)]
    )
    expect(
        "expect_column_quantile_values_to_be_between",
        "question lengths mirror production traffic",
        column="question_length",
        quantile_ranges=_quantile_ranges(lengths),
    )
    expect(
        "expect_column_kl_divergence_to_be_less_than",
        "the question-length distribution mirrors production traffic",
        column="question_length",
        partition_object=_length_partition(lengths),
        threshold=t["kl_max_question_length"],
        tail_weight_holdout=t["kl_tail_weight_holdout"],
    )

    suite = {
        "name": name,
        "expectations": expectations,
        "meta": {
            "derived_from": {
                "path": traffic_path.as_posix(),
                "rows": len(rows),
                "md5": hashlib.md5(traffic_path.read_bytes()).hexdigest(),
            },
            "derived_columns": DERIVED_COLUMNS,
            "production_only_fields": list(PRODUCTION_ONLY_FIELDS),
            "thresholds": dict(THRESHOLDS),
        },
        "notes": [f"{key}: {text}" for key, text in THRESHOLD_NOTES.items()],
    }
    # A round trip through GX checks every expectation's arguments and gives GX's layout.
    return _jsonable(_gx_suite(suite).to_json_dict())


def _quantile_ranges(lengths: np.ndarray) -> dict[str, list]:
    band = THRESHOLDS["quantile_probability_band"]
    tolerance = THRESHOLDS["quantile_relative_tolerance"]
    ranges = []
    for q in THRESHOLDS["quantiles"]:
        low = _quantile(lengths, max(0.0, q - band))
        high = _quantile(lengths, min(1.0, q + band))
        ranges.append([math.floor(low * (1 - tolerance)), math.ceil(high * (1 + tolerance))])
    return {"quantiles": list(THRESHOLDS["quantiles"]), "value_ranges": ranges}


def _length_partition(lengths: np.ndarray) -> dict[str, list]:
    cuts = np.linspace(0.0, 1.0, THRESHOLDS["question_length_bins"] + 1)
    bins = sorted({_quantile(lengths, float(q)) for q in cuts})
    if len(bins) == 1:  # every question has the same length: one bin around it
        bins.append(bins[0] + 1)
    # np.histogram is what GX's pandas engine bins with (last bin closed), so the weights
    # here are exactly traffic's own observed partition.
    counts, _ = np.histogram(lengths, bins)
    return {"bins": bins, "weights": [int(c) / len(lengths) for c in counts]}


def _quantile(values: np.ndarray, q: float) -> int:
    # "nearest" is GX's interpolation for pandas, so derived ranges compare like with like.
    return int(np.quantile(values, q, method="nearest"))


def write_suite(suite: dict[str, Any], path: Path) -> Path:
    """Write the suite as stable JSON (sorted keys, two-space indent, final newline)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(suite, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return path


def derive_suite_cli(traffic: Path, out: Path) -> Path:
    """`agentrft expectations derive --from TRAFFIC [--out OUT]`: derive and write the
    suite, named after OUT's stem; returns OUT."""
    return write_suite(derive_suite(Path(traffic), name=Path(out).stem), Path(out))


# --- validating one dataset --------------------------------------------------------------


@dataclass
class ValidationReport:
    """One dataset checked against the suite."""

    dataset: str
    rows: int
    evaluated: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    # observed KL divergences by column, for metrics
    kl_divergence: dict[str, float | None] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "rows": self.rows,
            "ok": self.ok,
            "evaluated": self.evaluated,
            "failures": self.failures,
            "skipped": self.skipped,
            "kl_divergence": self.kl_divergence,
        }


def validate_dataset(suite: dict[str, Any], rows_path: Path) -> ValidationReport:
    """Run the suite on one JSONL file through GX (an ephemeral context, a pandas frame
    with the derived columns). DataError when the file cannot be read."""
    return _validate_rows(suite, read_rows(rows_path), Path(rows_path))


def _validate_rows(
    suite: dict[str, Any], numbered: list[tuple[int, dict[str, Any]]], path: Path
) -> ValidationReport:
    thresholds = {**THRESHOLDS, **suite.get("meta", {}).get("thresholds", {})}
    n_samples = int(thresholds["sample_rows"])
    frame = _frame(numbered)
    report = ValidationReport(dataset=path.as_posix(), rows=len(frame), evaluated=0)
    run = _runnable(suite, frame, int(thresholds["distribution_min_rows"]), report)
    if not run:
        return report

    result = _run_gx({**suite, "expectations": run}, frame, n_samples)
    report.evaluated = len(result["results"])
    # GX does not keep the suite's order; failures are listed in it.
    position = {(e["type"], e["kwargs"].get("column")): i for i, e in enumerate(run)}
    for outcome in sorted(
        result["results"],
        key=lambda r: position.get(
            (r["expectation_config"]["type"], r["expectation_config"]["kwargs"].get("column")),
            len(run),
        ),
    ):
        config = outcome["expectation_config"]
        if config["type"] == "expect_column_kl_divergence_to_be_less_than":
            kl = outcome["result"].get("observed_value")
            report.kl_divergence[config["kwargs"]["column"]] = kl
        if not outcome["success"]:
            report.failures.append(_describe(outcome, frame, path, n_samples))
    return report


def _runnable(
    suite: dict[str, Any], frame: pd.DataFrame, min_rows: int, report: ValidationReport
) -> list[dict[str, Any]]:
    """The expectations GX can meaningfully run on `frame`; the others go to
    `report.skipped`, and a missing column the suite does not check becomes a failure."""
    run = []
    checked_exists = {
        e["kwargs"].get("column")
        for e in suite["expectations"]
        if e["type"] == "expect_column_to_exist"
    }
    for expectation in suite["expectations"]:
        column = expectation["kwargs"].get("column")
        if expectation["type"] in DISTRIBUTION_EXPECTATIONS and len(frame) < min_rows:
            reason = f"{len(frame)} rows < distribution_min_rows {min_rows}"
            report.skipped.append(_skip(expectation, reason))
        elif expectation["type"] != "expect_column_to_exist" and column not in (None, *frame):
            # GX would raise on the missing column; it is reported once, as missing.
            report.skipped.append(_skip(expectation, f"column {column!r} is missing"))
            source = "question" if column in DERIVED_COLUMNS else column
            if source not in checked_exists:
                checked_exists.add(source)
                report.failures.append(
                    _failure(
                        report.dataset,
                        "expect_column_to_exist",
                        source,
                        "missing",
                        "present",
                        None,
                        [],
                    )
                )
        else:
            run.append(expectation)
    return run


def _frame(numbered: list[tuple[int, dict[str, Any]]]) -> pd.DataFrame:
    # dtype=object keeps each value's JSON type (an int stays an int next to nulls), so
    # GX checks types value by value and can name the offending rows.
    frame = pd.DataFrame([row for _, row in numbered], dtype=object)
    frame[LINE_COLUMN] = [number for number, _ in numbered]
    if "question" in frame:
        frame["question_length"] = np.array(
            [float(len(q)) if isinstance(q, str) else np.nan for q in frame["question"]]
        )
    return frame


def _gx_suite(suite: dict[str, Any]) -> Any:
    from great_expectations.core import ExpectationSuite
    from great_expectations.exceptions import GreatExpectationsError
    from great_expectations.expectations.expectation_configuration import (
        ExpectationConfiguration,
    )

    expectations = []
    # One by one: ExpectationSuite itself only logs an invalid expectation and drops it.
    for number, expectation in enumerate(suite["expectations"], start=1):
        try:
            expectations.append(ExpectationConfiguration(**expectation).to_domain_obj())
        # GX reports a bad expectation as its own error or as a (pydantic) ValueError.
        except (GreatExpectationsError, ValueError, TypeError) as exc:
            raise DataError(
                f"expectation suite {suite.get('name')!r}, expectation {number} "
                f"({expectation.get('type')}): {exc}; fix it or derive the suite again with "
                "`agentrft expectations derive`"
            ) from None
    return ExpectationSuite(
        name=suite["name"],
        expectations=expectations,
        meta=suite.get("meta"),
        notes=suite.get("notes"),
    )


def _run_gx(suite: dict[str, Any], frame: pd.DataFrame, n_samples: int) -> dict[str, Any]:
    # Imported here: GX takes seconds to import, and the CLI must start fast.
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = (
        context.data_sources.add_pandas("dataset")
        .add_dataframe_asset("rows")
        .add_batch_definition_whole_dataframe("all_rows")
        .get_batch(batch_parameters={"dataframe": frame})
    )
    index_columns = [c for c in ("id", LINE_COLUMN) if c in frame]
    result = batch.validate(
        _gx_suite(suite),
        result_format={
            "result_format": "SUMMARY",
            "unexpected_index_column_names": index_columns,
            "partial_unexpected_count": n_samples,
        },
    )
    return _jsonable(result.to_json_dict())


def _skip(expectation: dict[str, Any], reason: str) -> dict[str, Any]:
    return {
        "expectation": expectation["type"],
        "column": expectation["kwargs"].get("column"),
        "reason": reason,
    }


def _failure(
    dataset: Path | str,
    expectation: str,
    column: str | None,
    observed: Any,
    expected: Any,
    unexpected_count: int | None,
    samples: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "dataset": Path(dataset).as_posix() if isinstance(dataset, Path) else dataset,
        "expectation": expectation,
        "column": column,
        "observed": observed,
        "expected": expected,
        "unexpected_count": unexpected_count,
        "samples": samples,
    }


def _describe(outcome: dict[str, Any], frame: pd.DataFrame, path: Path, n: int) -> dict[str, Any]:
    """A failed GX result as a failure dict: observed vs expected, and sample rows."""
    kind = outcome["expectation_config"]["type"]
    kwargs = outcome["expectation_config"]["kwargs"]
    column = kwargs.get("column")
    result = outcome.get("result") or {}
    error = _exception_message(outcome)
    if error:
        return _failure(path, kind, column, f"error: {error}", _expected(kind, kwargs), None, [])

    if kind == "expect_column_kl_divergence_to_be_less_than":
        details = result.get("details", {})
        kl = result.get("observed_value")
        observed = {
            # GX reports an infinite divergence as None
            "kl_divergence": "inf" if kl is None else kl,
            "weights": _labelled(details.get("observed_partition", {})),
        }
        # GX's expected partition includes the tail holdout it compared against.
        expected = {
            "kl_divergence_at_most": kwargs["threshold"],
            "weights": _labelled(details.get("expected_partition") or kwargs["partition_object"]),
        }
        samples = _over_represented_rows(frame, column, details, n)
        return _failure(path, kind, column, observed, expected, None, samples)

    if kind == "expect_column_quantile_values_to_be_between":
        observed_values = result.get("observed_value", {})
        ranges = kwargs["quantile_ranges"]
        observed = dict(
            zip(map(str, observed_values["quantiles"]), observed_values["values"], strict=True)
        )
        samples = _out_of_range_rows(
            frame, column, observed_values["values"], ranges["value_ranges"], n
        )
        return _failure(path, kind, column, observed, _expected(kind, kwargs), None, samples)

    if "unexpected_count" in result:  # a column map expectation: GX named the rows
        values = frame.set_index(LINE_COLUMN)[column]
        samples = [
            {
                "id": index.get("id"),
                "line": index[LINE_COLUMN],
                "value": _short(values[index[LINE_COLUMN]]),
            }
            for index in result.get("partial_unexpected_index_list", [])[:n]
        ]
        observed = f"{result['unexpected_count']} of {result.get('element_count')} rows"
        return _failure(
            path,
            kind,
            column,
            observed,
            _expected(kind, kwargs),
            result["unexpected_count"],
            samples,
        )
    observed = result.get("observed_value", "missing" if kind == "expect_column_to_exist" else None)
    return _failure(path, kind, column, observed, _expected(kind, kwargs), None, [])


def _expected(kind: str, kwargs: dict[str, Any]) -> Any:
    match kind:
        case "expect_column_to_exist":
            return "present"
        case "expect_column_values_to_not_be_null":
            return "no nulls"
        case "expect_column_values_to_be_unique":
            return "unique values"
        case "expect_column_values_to_be_of_type":
            return f"type {kwargs['type_']}"
        case "expect_column_values_to_be_in_type_list":
            return f"one of types {kwargs['type_list']}"
        case "expect_column_values_to_be_in_set":
            return {"in_set": kwargs["value_set"]}
        case "expect_column_quantile_values_to_be_between":
            ranges = kwargs["quantile_ranges"]
            return dict(zip(map(str, ranges["quantiles"]), ranges["value_ranges"], strict=True))
        case "expect_column_kl_divergence_to_be_less_than":
            return {
                "kl_divergence_at_most": kwargs["threshold"],
                "weights": _labelled(kwargs["partition_object"]),
            }
    return {key: value for key, value in kwargs.items() if key != "column"}


def _exception_message(outcome: dict[str, Any]) -> str | None:
    info = outcome.get("exception_info") or {}
    # GX nests exception info per metric when a metric fails to resolve.
    infos = [info] if "raised_exception" in info else list(info.values())
    messages = [i.get("exception_message") for i in infos if i.get("raised_exception")]
    return "; ".join(m for m in messages if m) or None


def _labelled(partition: dict[str, Any]) -> dict[str, float]:
    """A partition as {label: weight}: categories by value, bins as "[a, b)" plus tails."""
    if "values" in partition:
        return {
            str(v): round(w, 4)
            for v, w in zip(partition["values"], partition["weights"], strict=True)
        }
    bins, weights = partition.get("bins", []), partition.get("weights", [])
    labels = {}
    tails = partition.get("tail_weights", [0.0, 0.0])
    if bins:
        labels[f"< {bins[0]}"] = round(tails[0], 4)
    for i, w in enumerate(weights):
        close = "]" if i == len(weights) - 1 else ")"
        labels[f"[{bins[i]}, {bins[i + 1]}{close}"] = round(w, 4)
    if bins:
        labels[f"> {bins[-1]}"] = round(tails[1], 4)
    return labels


def _over_represented_rows(
    frame: pd.DataFrame, column: str, details: dict[str, Any], n: int
) -> list[dict[str, Any]]:
    """Rows from the region (category or bin) that gained most weight against traffic."""
    observed = _labelled(details.get("observed_partition", {}))
    expected = _labelled(details.get("expected_partition", {}))
    if not observed:
        return []
    region = max(observed, key=lambda label: observed[label] - expected.get(label, 0.0))
    values = frame[column]
    if "values" in details.get("observed_partition", {}):
        mask = values.astype(str) == region
    else:
        bins = details["observed_partition"]["bins"]
        numeric = pd.to_numeric(values, errors="coerce")
        if region.startswith("<"):
            mask = numeric < bins[0]
        elif region.startswith(">"):
            mask = numeric > bins[-1]
        else:
            low, high = (float(x) for x in region.strip("[])").split(", "))
            mask = (numeric >= low) & (
                (numeric <= high) if region.endswith("]") else (numeric < high)
            )
    return _rows(frame, mask, column, n)


def _out_of_range_rows(
    frame: pd.DataFrame, column: str, observed: list[float], ranges: list[list[float]], n: int
) -> list[dict[str, Any]]:
    """Rows beyond the bound that a failed quantile crossed."""
    numeric = pd.to_numeric(frame[column], errors="coerce")
    mask = pd.Series(False, index=frame.index)
    for value, (low, high) in zip(observed, ranges, strict=True):
        if value > high:
            mask |= numeric > high
        elif value < low:
            mask |= numeric < low
    return _rows(frame, mask, column, n)


def _rows(frame: pd.DataFrame, mask: pd.Series, column: str, n: int) -> list[dict[str, Any]]:
    picked = frame[mask.fillna(False).astype(bool)].head(n)
    return [
        {"id": row.get("id"), "line": row[LINE_COLUMN], "value": _short(row[column])}
        for _, row in picked.iterrows()
    ]


# --- leakage and reference answers -------------------------------------------------------


def check_leakage(
    train: list[tuple[int, dict[str, Any]]],
    eval_rows: list[tuple[int, dict[str, Any]]],
    *,
    n: int = THRESHOLDS["sample_rows"],
) -> list[dict[str, Any]]:
    """Failures for ids and normalised questions shared by train and eval."""
    failures = []
    for column, key in (("id", lambda v: v), ("question", normalize_question)):
        seen = {
            key(row[column]): row.get("id") for _, row in train if isinstance(row.get(column), str)
        }
        shared = [
            {
                "id": row.get("id"),
                "line": line,
                "train_id": seen[key(row[column])],
                "value": _short(row[column]),
            }
            for line, row in eval_rows
            if isinstance(row.get(column), str) and key(row[column]) in seen
        ]
        if shared:
            failures.append(
                _failure(
                    "train+eval",
                    "train_eval_disjoint",
                    column,
                    f"{len(shared)} eval rows share a{' normalised' if column == 'question' else 'n'} "
                    f"{column} with train",
                    "no shared values",
                    len(shared),
                    shared[:n],
                )
            )
    return failures


def check_references(
    grader: dict[str, Any],
    numbered: list[tuple[int, dict[str, Any]]],
    path: Path,
    *,
    n: int = THRESHOLDS["sample_rows"],
) -> list[dict[str, Any]]:
    """Failures for rows the grader cannot use: a `{{item.*}}` variable of any sub-grader
    that the row lacks, or a reference a reference-parsing grader (numeric) rejects when
    the reference itself is graded as the answer. GraderConfigError for a bad grader."""
    validate_grader(grader)
    leaves = list(_leaf_graders(grader, "grader"))
    bad = []
    for line, row in numbered:
        sample = sample_from_text(str(row.get("reference_answer") or ""))
        problems = []
        for where, leaf in leaves:
            problems += [f"{where}: {p}" for p in _missing_item_variables(leaf, sample, row)]
            if leaf["type"] in REFERENCE_PARSING_GRADERS and not problems:
                errors = grade(leaf, sample, row).errors
                problems += [f"{where}: {kind}: {msg}" for kind, msg in errors.items()]
        if problems:
            bad.append(
                {
                    "id": row.get("id"),
                    "line": line,
                    "value": _short(row.get("reference_answer")),
                    "error": "; ".join(problems),
                }
            )
    if not bad:
        return []
    return [
        _failure(
            path,
            "reference_answer_gradable",
            "reference_answer",
            f"{len(bad)} of {len(numbered)} rows the grader cannot use",
            f"grader {grader.get('name') or grader['type']!r} reads every row without error",
            len(bad),
            bad[:n],
        )
    ]


def check_row_shapes(
    numbered: list[tuple[int, dict[str, Any]]],
    path: Path,
    *,
    n: int = THRESHOLDS["sample_rows"],
) -> list[dict[str, Any]]:
    """Failures for rows a rollout could not start from, whatever the suite says: messages
    that are not a list of `{"role", "content"}` objects, own `tools` that are not valid
    tool schemas (rows without `tools` use the config's tools.schemas), and rows too large
    to travel in a tool request (`MAX_ROW_BYTES`). The tool client and the chat template
    would otherwise refuse such a row mid-training."""
    checked_tools: dict[str, str | None] = {}  # rows usually share one list: check each once
    bad: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for line, row in numbered:
        problems = []
        messages = row.get("messages")
        if "messages" in row and not _messages_ok(messages):
            problems.append(
                (
                    "messages_well_formed",
                    "messages",
                    "a non-empty list of objects with a string `role` and `content`",
                    _short(messages),
                )
            )
        if "tools" in row:
            key = json.dumps(row["tools"], sort_keys=True, default=str)
            if key not in checked_tools:
                try:
                    tool_validators(row["tools"], where="tools", error=DataError)
                    checked_tools[key] = None
                except DataError as exc:
                    checked_tools[key] = str(exc)
            if checked_tools[key]:
                problems.append(
                    (
                        "tool_schemas_valid",
                        "tools",
                        "Chat Completions tool schemas: a function.name each, once, "
                        "parameters a JSON schema",
                        checked_tools[key],
                    )
                )
        size = len(json.dumps(row, ensure_ascii=False, default=str).encode())
        if size > MAX_ROW_BYTES:
            problems.append(
                (
                    "row_fits_tool_request",
                    "(row)",
                    f"at most {MAX_ROW_BYTES} bytes",
                    f"{size} bytes",
                )
            )
        for expectation, column, expected, error in problems:
            bad.setdefault((expectation, column, expected), []).append(
                {"id": _short(row.get("id")), "line": line, "error": error}
            )
    return [
        _failure(
            path,
            expectation,
            column,
            f"{len(rows)} of {len(numbered)} rows",
            expected,
            len(rows),
            rows[:n],
        )
        for (expectation, column, expected), rows in bad.items()
    ]


def _messages_ok(messages: Any) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), (str, list))
            for m in messages
        )
    )


def _leaf_graders(grader: dict[str, Any], where: str):
    if grader["type"] == "multi":
        for name, sub in grader["graders"].items():
            yield from _leaf_graders(sub, f"{where}.graders.{name}")
    else:
        yield where, grader


def _missing_item_variables(grader: dict[str, Any], sample: dict, row: dict) -> list[str]:
    problems = []
    for template in _strings(grader):
        for variable in template_variables(template):
            if variable.split(".", 1)[0].split("[", 1)[0] != "item":
                continue
            try:
                lookup_variable(variable, sample, row)
            except GraderError as exc:
                problems.append(str(exc))
    return problems


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for sub in value.values():
            yield from _strings(sub)
    elif isinstance(value, list):
        for sub in value:
            yield from _strings(sub)


# --- the stage --------------------------------------------------------------------------


@dataclass
class StageReport:
    """The validate_data stage's outcome: per-dataset GX reports plus leakage and
    reference-answer checks. `failures` lists them all; `ok` when there are none."""

    suite: str
    datasets: list[ValidationReport]
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [f for d in self.datasets for f in d.failures] + self.checks

    @property
    def ok(self) -> bool:
        return not self.failures

    def metrics(self) -> dict[str, float]:
        """Flat `validate/...` metrics for MLflow."""
        metrics: dict[str, float] = {"validate/failures": float(len(self.failures))}
        for report in self.datasets:
            split = Path(report.dataset).stem
            metrics[f"validate/{split}_rows"] = float(report.rows)
            metrics[f"validate/{split}_failed_expectations"] = float(len(report.failures))
            for column, kl in sorted(report.kl_divergence.items()):
                metrics[f"validate/{split}_kl_{column}"] = math.inf if kl is None else float(kl)
        return metrics

    def to_json(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "ok": self.ok,
            "datasets": [d.to_json() for d in self.datasets],
            "checks": self.checks,
            "failures": self.failures,
        }

    def to_markdown(self) -> str:
        verdict = "passed" if self.ok else f"FAILED ({len(self.failures)} failures)"
        lines = [
            f"# Data validation: {verdict}",
            "",
            f"Suite `{self.suite}`.",
            "",
            "| dataset | rows | expectations run | failed | skipped |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for d in self.datasets:
            lines.append(
                f"| {d.dataset} | {d.rows} | {d.evaluated} | {len(d.failures)} | {len(d.skipped)} |"
            )
        if self.failures:
            lines += [
                "",
                "## Failures",
                "",
                "| dataset | expectation | column | observed | expected | sample rows |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
            for f in self.failures:
                cells = [
                    f["dataset"],
                    f"`{f['expectation']}`",
                    f"`{f['column']}`",
                    _cell(f["observed"]),
                    _cell(f["expected"]),
                    "<br>".join(_cell(s) for s in f["samples"]) or "-",
                ]
                lines.append("| " + " | ".join(cells) + " |")
        skipped = [(d.dataset, s) for d in self.datasets for s in d.skipped]
        if skipped:
            lines += ["", "## Skipped", ""]
            lines += [
                f"- {ds}: `{s['expectation']}` on `{s['column']}`: {s['reason']}"
                for ds, s in skipped
            ]
        return "\n".join(lines) + "\n"


def validate_splits(
    suite: dict[str, Any] | None, train_path: Path, eval_path: Path, grader: dict[str, Any]
) -> StageReport:
    """Validate train and eval against the suite (None: no suite), check that they share
    no id or normalised question, that the grader can use every row's reference answer and
    that a rollout can start from every row."""
    suite = suite or {"name": "(no suite)", "expectations": [], "meta": {}}
    train_path, eval_path = Path(train_path), Path(eval_path)
    n = int(
        suite.get("meta", {}).get("thresholds", {}).get("sample_rows", THRESHOLDS["sample_rows"])
    )
    train, eval_rows = read_rows(train_path), read_rows(eval_path)
    checks = check_leakage(train, eval_rows, n=n)
    checks += check_references(grader, train, train_path, n=n)
    checks += check_references(grader, eval_rows, eval_path, n=n)
    checks += check_row_shapes(train, train_path, n=n)
    checks += check_row_shapes(eval_rows, eval_path, n=n)
    return StageReport(
        suite=suite["name"],
        datasets=[
            _validate_rows(suite, train, train_path),
            _validate_rows(suite, eval_rows, eval_path),
        ],
        checks=checks,
    )


# --- formatting --------------------------------------------------------------------------


def _short(value: Any, limit: int = 120) -> Any:
    """A value small enough for a report: long strings and containers are cut."""
    value = _jsonable(value)
    if isinstance(value, str):
        return value if len(value) <= limit else value[: limit - 3] + "..."
    if isinstance(value, (list, dict)):
        text = json.dumps(value, ensure_ascii=False)
        return value if len(text) <= limit else text[: limit - 3] + "..."
    return value


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text.replace("|", "\\|").replace("\n", " ")


def _jsonable(value: Any) -> Any:
    """Plain JSON values: numpy scalars unwrapped, NaN as None, tuples as lists."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


# --- the Prefect task --------------------------------------------------------------------


def check_pin(data_dir: Path, dvc_file: Path) -> list[dict[str, Any]]:
    """The data directory must be exactly what `data.dvc` pins (else the data version
    every run is tagged with would be a lie)."""
    from envs.finqa.dvc_pin import dir_md5, pinned_md5

    pinned, actual = pinned_md5(dvc_file), dir_md5(data_dir)
    if pinned == actual:
        return []
    return [{
        "dataset": str(data_dir), "expectation": "dvc_pin_matches", "column": "(all files)",
        "observed": actual, "expected": pinned,
        "samples": [f"run `dvc checkout` (or `agentrft data generate`), or `dvc add {data_dir}` to pin new data"],
    }]


@task(name="validate_data", persist_result=True, cache_key_fn=lambda _ctx, params: params["stage_key"])
def validate_data(config: PipelineConfig, ctx: RunContext, stage_key: str) -> dict[str, Any]:
    """GX suite, leakage, reference and pin checks on train and eval; fails with the report."""
    data = config.data
    with stage_run(ctx, "validate_data", config) as (client, run_id):
        suite = load_suite(Path(data.expectations_suite)) if data.expectations_suite else None
        report = validate_splits(suite, Path(data.train_file), Path(data.eval_file), config.grader)
        if data.dvc_file:
            report.checks += check_pin(Path(data.data_dir), Path(data.dvc_file))
        log_datasets(ctx, run_id, {"train": Path(data.train_file), "eval": Path(data.eval_file)})
        log_metrics(client, run_id, report.metrics())
        markdown = report.to_markdown()
        log_text(client, run_id, markdown, "validation_report.md")
        log_json(client, run_id, _jsonable(report.to_json()), "validation_report.json")
        publish_summary(ctx, "validate_data", run_id, markdown)
        if not report.ok:
            first = report.failures[0]
            raise DataError(
                f"validate_data: {len(report.failures)} failed checks; first: `{first['expectation']}` "
                f"on `{first['column']}` of {first['dataset']}: observed {_short(first['observed'])}, "
                f"expected {_short(first['expected'])}. Full report: validation_report.md in MLflow run {run_id}"
            )
    return {"run_id": run_id, "ok": True, "metrics": report.metrics()}
