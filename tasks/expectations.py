"""Expectations derived from production traffic, kept in a Great Expectations file context.

RFT learns the distribution it is trained on, so the datasets must look like what
production sends. GX 1.x has no profilers; `derive_suite` is ours and assumes nothing
about a job beyond OpenAI's RFT row format. From the traffic log it derives, for any
dataset:

- `messages`: the role patterns production sends (`system>user`), the number of
  messages, and the length of the user content (quantiles and a KL bound on its binned
  distribution);
- `tools`: the tool sets production offers (by function names);
- every other field by its JSON type: the types seen; for strings, the length quantiles,
  and for low-cardinality fields (at most 50 values, each seen 10 times on average) the
  value set and a KL bound on its distribution; for numbers, the range and quantiles;
  for objects, their key sets; for lists, their lengths;
- the fields that must be present and non-null: `messages`, plus those the caller names
  (the grader's `{{item.*}}` fields, `tools` when the rows carry the tool schemas);
- unique ids when production rows carry ids.

Fields that move with time (`time_fields`: a report year, a fiscal period) keep their type
check only: a temporal hold-out (a test split of later periods than training's) differs
from earlier data there by design, and production's newest traffic does too. The demo's
suite names `year` (its test split asks about later reports than train and validation).

A check applies to whichever fields a dataset has (a production-only field such as a
timestamp is skipped, and listed as skipped); distribution checks need
`distribution_min_rows` rows. KL bounds grow with the number of categories or bins: the
base plus the 99.9% quantile of the divergence sampling noise alone produces at
`distribution_min_rows` rows (chi2(k - 1) / 2n).

The suite lives in a GX file data context (`data.expectations_dir`, committed with the
project: great_expectations.yml, `expectations/<suite>.json`, the checkpoint and its
validation definition), and each dataset is validated by running the suite's Checkpoint,
which also builds the Data Docs site under `uncommitted/data_docs/`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from trainer.data import read_numbered, user_text
from trainer.errors import DataError

LINE_COLUMN = "_line"  # each row's line in its JSONL file, so failures can name rows
THRESHOLDS: dict[str, Any] = {
    "kl_base": 0.1,
    "kl_noise_quantile": 0.999,
    "kl_tail_weight_holdout": 0.01,
    "length_bins": 10,
    "quantiles": [0.05, 0.25, 0.5, 0.75, 0.95],
    "quantile_probability_band": 0.05,
    "quantile_spread_tolerance": 0.1,
    "categorical_max_values": 50,
    "categorical_min_rows_per_value": 10,
    "distribution_min_rows": 200,
    "sample_rows": 5,
}
DISTRIBUTION_EXPECTATIONS = (
    "expect_column_kl_divergence_to_be_less_than",
    "expect_column_quantile_values_to_be_between",
)
DATASOURCE, ASSET, BATCH = "agentrft", "dataset", "whole_dataset"


# --- the frame GX validates: the rows plus derived columns --------------------------------


def _type_name(value: Any) -> str:
    return "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else type(value).__name__


def derived_row(row: dict[str, Any]) -> dict[str, Any]:
    """The columns the suite reads from one row: its fields (containers as JSON text) and
    the derived `messages.*`, `tools.names`, `<field>.length` and `<field>.keys`."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        out[key] = json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else value
        if isinstance(value, str | list):
            out[f"{key}.length"] = len(value)
        if isinstance(value, dict):
            out[f"{key}.keys"] = ",".join(sorted(map(str, value)))
    messages = row.get("messages")
    if isinstance(messages, list):
        out["messages.count"] = len(messages)
        out["messages.roles"] = ">".join(str(m.get("role")) if isinstance(m, dict) else "?" for m in messages)
        out["messages.user_chars"] = len(user_text(row))
    tools = row.get("tools")
    if isinstance(tools, list):
        names = [t.get("function", {}).get("name", "?") if isinstance(t, dict) else "?" for t in tools]
        out["tools.names"] = ",".join(sorted(map(str, names)))
    return out


def dataset_frame(numbered: list[tuple[int, dict[str, Any]]]) -> pd.DataFrame:
    # dtype=object keeps each value's JSON type (an int stays an int next to nulls), so GX
    # checks types value by value and can name the offending rows.
    frame = pd.DataFrame([derived_row(row) for _, row in numbered], dtype=object)
    frame[LINE_COLUMN] = [number for number, _ in numbered]
    return frame


# --- deriving the suite --------------------------------------------------------------------


def _kl_threshold(categories: int) -> float:
    from scipy.stats import chi2

    t = THRESHOLDS
    noise = chi2.ppf(t["kl_noise_quantile"], max(categories - 1, 1)) / (2 * t["distribution_min_rows"])
    return round(t["kl_base"] + float(noise), 4)


def _quantile(values: np.ndarray, q: float) -> float:
    # "nearest" is GX's interpolation for pandas, so derived ranges compare like with like.
    return float(np.quantile(values, q, method="nearest"))


def _quantile_ranges(values: np.ndarray) -> dict[str, list]:
    t = THRESHOLDS
    spread = _quantile(values, 0.95) - _quantile(values, 0.05)
    slack = t["quantile_spread_tolerance"] * max(spread, 1.0)
    ranges = []
    for q in t["quantiles"]:
        low = _quantile(values, max(0.0, q - t["quantile_probability_band"]))
        high = _quantile(values, min(1.0, q + t["quantile_probability_band"]))
        ranges.append([math.floor(low - slack), math.ceil(high + slack)])
    return {"quantiles": list(t["quantiles"]), "value_ranges": ranges}


def _binned(values: np.ndarray) -> dict[str, list]:
    cuts = np.linspace(0.0, 1.0, THRESHOLDS["length_bins"] + 1)
    bins = sorted({_quantile(values, float(q)) for q in cuts})
    if len(bins) == 1:  # every value the same: one bin around it
        bins.append(bins[0] + 1)
    # np.histogram is what GX's pandas engine bins with (last bin closed), so the weights
    # here are exactly traffic's own observed partition.
    counts, _ = np.histogram(values, bins)
    return {"bins": bins, "weights": [int(c) / len(values) for c in counts]}


def _categorical(values: list[Any]) -> bool:
    t = THRESHOLDS
    distinct = len(set(values))
    return 0 < distinct <= t["categorical_max_values"] and len(values) / distinct >= t["categorical_min_rows_per_value"]


def derive_suite(traffic_path: Path, *, name: str = "production_traffic",
                 required: list[str] | None = None, time_fields: list[str] | None = None) -> dict[str, Any]:
    """The suite (GX's JSON layout) describing a production traffic log; `required` names
    the fields every item must carry besides `messages`; `time_fields` are checked for
    their type alone (no range, quantiles or mix)."""
    traffic_path = Path(traffic_path)
    numbered = read_numbered(traffic_path)
    if not numbered:
        raise DataError(f"{traffic_path}: the traffic log has no rows; the suite is derived from them")
    rows = [derived_row(row) for _, row in numbered]
    if not any("messages.roles" in row for row in rows):
        raise DataError(f"{traffic_path}: no row has a `messages` list (OpenAI RFT format); the suite is derived "
                        "from the messages production sends")
    fields = list(dict.fromkeys(key for _, row in numbered for key in row))
    unknown = sorted(set(time_fields or []) - set(fields))
    if unknown:
        raise DataError(f"{traffic_path}: time fields {unknown} are in no row of the traffic log (its fields: "
                        f"{fields}); name fields the rows carry")
    expectations: list[dict[str, Any]] = []

    def expect(kind: str, why: str, **kwargs: Any) -> None:
        expectations.append({"type": kind, "kwargs": kwargs, "meta": {"why": why}})

    def column(key: str) -> list[Any]:
        return [row[key] for row in rows if row.get(key) is not None]

    for key in dict.fromkeys(["messages", *(required or [])]):
        expect("expect_column_to_exist", "every item needs it (messages, the grader's and the tools' fields)",
               column=key)
        expect("expect_column_values_to_not_be_null", "every item needs it", column=key)
    for key in fields:
        types = sorted({_type_name(row[key]) for _, row in numbered if row.get(key) is not None})
        types = ["str" if t in ("dict", "list") else t for t in types]  # containers are JSON text in the frame
        if types:
            expect("expect_column_values_to_be_in_type_list", "values keep the JSON types production uses",
                   column=key, type_list=sorted(set(types)))
    if all(row.get("id") is not None for _, row in numbered):
        expect("expect_column_values_to_be_unique", "items are told apart by id", column="id")

    def distribution(key: str, why: str) -> None:
        values = np.array(column(key), dtype=float)
        if not len(values):
            return
        expect("expect_column_values_to_be_between", f"{why}: within production's range", column=key,
               min_value=math.floor(values.min() - THRESHOLDS["quantile_spread_tolerance"] * np.ptp(values)),
               max_value=math.ceil(values.max() + THRESHOLDS["quantile_spread_tolerance"] * np.ptp(values)),
               mostly=0.99)
        expect("expect_column_quantile_values_to_be_between", f"{why}: quantiles mirror production",
               column=key, quantile_ranges=_quantile_ranges(values))

    def categories(key: str, why: str) -> None:
        values = [str(v) for v in column(key)]
        counts = Counter(values)
        labels = sorted(counts)
        expect("expect_column_values_to_be_in_set", f"{why}: only values production has", column=key,
               value_set=labels)
        expect("expect_column_kl_divergence_to_be_less_than", f"{why}: the mix mirrors production", column=key,
               partition_object={"values": labels, "weights": [counts[v] / len(values) for v in labels]},
               threshold=_kl_threshold(len(labels)), tail_weight_holdout=THRESHOLDS["kl_tail_weight_holdout"])

    categories("messages.roles", "the message structure")
    distribution("messages.count", "the number of messages")
    lengths = np.array(column("messages.user_chars"), dtype=float)
    distribution("messages.user_chars", "the length of what users ask")
    expect("expect_column_kl_divergence_to_be_less_than", "the length of what users ask mirrors production",
           column="messages.user_chars", partition_object=_binned(lengths),
           threshold=_kl_threshold(THRESHOLDS["length_bins"]), tail_weight_holdout=THRESHOLDS["kl_tail_weight_holdout"])
    if column("tools.names"):
        expect("expect_column_values_to_be_in_set", "only the tool sets production offers", column="tools.names",
               value_set=sorted(set(column("tools.names"))))
    for key in fields:
        if key in ("messages", "tools", "id", *(time_fields or [])):
            continue
        values = column(key)
        kinds = {_type_name(v) for v in values}
        if kinds <= {"str", "bool"} and _categorical(values):
            categories(key, f"`{key}`")
        elif kinds == {"str"}:
            distribution(f"{key}.length", f"the length of `{key}`")
        elif kinds <= {"int", "float"}:
            distribution(key, f"`{key}`")
        elif kinds == {"dict"} and column(f"{key}.keys"):
            expect("expect_column_values_to_be_in_set", f"`{key}` has the keys production's has",
                   column=f"{key}.keys", value_set=sorted(set(column(f"{key}.keys"))))
        elif kinds == {"list"}:
            distribution(f"{key}.length", f"the length of `{key}`")
    suite = {
        "name": name,
        "expectations": expectations,
        "meta": {
            "derived_from": {"path": traffic_path.as_posix(), "rows": len(rows),
                             "md5": hashlib.md5(traffic_path.read_bytes(), usedforsecurity=False).hexdigest()},
            "thresholds": dict(THRESHOLDS),
            "time_fields": list(time_fields or []),
        },
    }
    return suite


def required_fields(config: Any) -> list[str]:
    """The item fields a config's grader templates read, plus `tools` when the rows carry
    the tool schemas (no tools.schemas in the config)."""
    from trainer.graders.templates import template_variables

    fields: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            for variable in template_variables(value):
                head, _, rest = variable.partition(".")
                if head == "item" and rest:
                    fields.append(rest.split(".")[0].split("[")[0])
        elif isinstance(value, dict):
            for sub in value.values():
                walk(sub)
        elif isinstance(value, list):
            for sub in value:
                walk(sub)

    walk(config.grader)
    if config.tools.schemas is None:
        fields.append("tools")
    return list(dict.fromkeys(fields))


# --- the GX file data context -----------------------------------------------------------------


def _json_safe_quantile_results() -> None:
    """GX 1.24's ExpectColumnQuantileValuesToBeBetween returns numpy bools (`np.all`,
    `isclose`), which GX's own validation-results store cannot serialise: Checkpoint.run
    fails with "Object of type bool is not JSON serializable". Until GX fixes it, its
    result is made plain Python here (the values and the verdict are unchanged)."""
    from great_expectations.expectations.core.expect_column_quantile_values_to_be_between import (
        ExpectColumnQuantileValuesToBeBetween as Quantiles,
    )

    original = Quantiles._validate
    if getattr(original, "json_safe", False):
        return

    def _validate(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        outcome = original(self, *args, **kwargs)
        details = outcome["result"]["details"]
        details["success_details"] = [bool(ok) for ok in details["success_details"]]
        return {**outcome, "success": bool(outcome["success"])}

    _validate.json_safe = True  # type: ignore[attr-defined]
    Quantiles._validate = _validate


def gx_context(root: Path) -> Any:
    """The project's GX file data context at `root` (created on first use), quiet."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    _json_safe_quantile_results()
    context = gx.get_context(mode="file", context_root_dir=str(root))
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    context.variables.save()
    return context


def _expectation(spec: dict[str, Any], number: int, suite: str) -> Any:
    from great_expectations.exceptions import GreatExpectationsError
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    try:
        return ExpectationConfiguration(**spec).to_domain_obj()
    # GX reports a bad expectation as its own error or as a (pydantic) ValueError.
    except (GreatExpectationsError, ValueError, TypeError) as exc:
        raise DataError(
            f"expectation suite {suite!r}, expectation {number} ({spec.get('type')}): {exc}; fix it or derive the "
            "suite again with `agentrft expectations derive`"
        ) from None


def save_suite(root: Path, suite: dict[str, Any]) -> Path:
    """Store the suite in the context with its Checkpoint (one validation definition on
    the pipeline's dataframe asset, and a Data Docs update); returns the suite's file."""
    import great_expectations as gx

    context = gx_context(root)
    source = context.data_sources.add_or_update_pandas(DATASOURCE)
    asset = next((a for a in source.assets if a.name == ASSET), None) or source.add_dataframe_asset(ASSET)
    batch = next((b for b in asset.batch_definitions if b.name == BATCH), None) \
        or asset.add_batch_definition_whole_dataframe(BATCH)
    name = suite["name"]
    for existing in (context.checkpoints, context.validation_definitions, context.suites):
        try:
            existing.delete(name)
        except Exception:  # noqa: BLE001 - GX raises its own "not found" types per store
            pass
    gx_suite = context.suites.add(gx.ExpectationSuite(
        name=name, expectations=[_expectation(e, i, name) for i, e in enumerate(suite["expectations"], start=1)],
        meta=suite.get("meta"),
    ))
    definition = context.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=gx_suite))
    context.checkpoints.add(gx.Checkpoint(
        name=name, validation_definitions=[definition],
        actions=[gx.checkpoint.UpdateDataDocsAction(name="update_data_docs")],
        result_format={"result_format": "SUMMARY", "unexpected_index_column_names": ["id", LINE_COLUMN],
                       "partial_unexpected_count": THRESHOLDS["sample_rows"]},
    ))
    return root / "expectations" / f"{name}.json"


def load_suite(root: Path, name: str) -> Any:
    """The stored suite (GX's object); DataError when it is missing."""
    context = gx_context(root)
    try:
        return context.suites.get(name)
    except Exception:  # noqa: BLE001 - GX's not-found error type differs between stores
        raise DataError(
            f"{root}: no expectation suite {name!r}; derive one with `agentrft expectations derive --from "
            "<production traffic> --config <job.yaml>`"
        ) from None


def derive_and_save(traffic: Path, root: Path, *, name: str, required: list[str],
                    time_fields: list[str] | None = None) -> Path:
    """`agentrft expectations derive`: derive the suite and store it with its checkpoint."""
    return save_suite(root, derive_suite(traffic, name=name, required=required, time_fields=time_fields))
