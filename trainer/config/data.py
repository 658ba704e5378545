"""`data`: the DVC-pinned splits, the production traffic log and its expectations suite."""

from __future__ import annotations

from pydantic import Field

from trainer.config.section import Section


class ShiftEvaluation(Section):
    file: str = Field(description="Items (OpenAI RFT JSONL) of a question other than the test split's.")
    measures: str = Field(description="What its figures measure, printed beside them.")


class DataConfig(Section):
    dvc_file: str | None = Field(
        None, description="DVC file (`dvc add` output) pinning the data; its md5 is the data version "
        "and the data must match it. None: the data version is the md5 of the dataset files."
    )
    train_file: str = Field("data/train.jsonl", description="Training items (OpenAI RFT JSONL).")
    validation_file: str = Field(
        "data/validation.jsonl", description="Validation items: in-training evaluation, checkpoint choice, "
        "prompt-variant choice and the baseline gates."
    )
    test_file: str | None = Field(
        "data/test.jsonl", description="Test items: read only by the regression evaluation and the promotion "
        "decision. None: a seeded half of the validation file is set aside as the test split (reported)."
    )
    production_traffic_file: str | None = Field(
        "data/production_traffic.jsonl", description="Production traffic log (same shape as the items, plus what "
        "production observed); the expectation suite is derived from it."
    )
    expectations_dir: str = Field(
        "expectations", description="Great Expectations file data context (great_expectations.yml, suites, "
        "checkpoints)."
    )
    expectations_suite: str | None = Field(
        "production_traffic", description="Suite in the data context the datasets are validated against; None "
        "skips the suite (leakage and gradability checks still run)."
    )
    test_ledger: str | None = Field(
        "auto", description="Ledger of every reading of the test split (regression_eval, `agentrft eval --split "
        "test`), one JSON line each; commit it with the project, since an MLflow store's count starts at zero on "
        "every clone. auto: test_readings.jsonl beside `dvc_file` (outside the pinned data), else "
        "beside the test file (the validation file without one); None: readings are tagged in MLflow only.")
    max_train_items: int | None = Field(None, ge=1, description="Use only the first N training items.")
    max_validation_items: int | None = Field(None, ge=1, description="Use only the first N validation items.")
    max_test_items: int | None = Field(None, ge=1, description="Use only the first N test items.")
    probe_items: int = Field(
        20, ge=0, description="Validation items the grader's reward-hacking probes run on in validate_data, before "
        "anything trains: a probe the grader pays beyond its plain content stops the pipeline (0: no probes).")
    probe_max_error_share: float = Field(
        0.25, ge=0, le=1, description="Share of the probes the grader may fail to grade (grader errors, never "
        "scores) before the probe check fails: past it, the check tested too little to pass.")
    corpus_dir: str | None = Field(
        "auto", description="Folder of the documents the items' `gold_pages` name (the tools' corpus): the probes "
        "paste an item's gold page and list its numbers. auto: the `corpus` folder beside the validation file, "
        "when there is one; None: those probes have nothing to try (the report says so).")
    shift_evaluations: dict[str, ShiftEvaluation] = Field(
        default_factory=dict, description="Named splits that measure another question than the test split (later "
        "periods, new customers): read only by `agentrft shift NAME`, each reading counted in the test ledger.")
