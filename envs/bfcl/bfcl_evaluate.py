"""BFCL's own evaluation (`bfcl evaluate`) of model results, entry by entry.

Given results in BFCL's result-file shape (`{"id", "result"}` per entry, `result` what its
handler recorded: `[{name: arguments_json}]` or the response's text), this writes them as
BFCL's result files for the model the grader server registers, runs bfcl_eval's evaluation
runner on them (`eval_runner.main`, partial evaluation: only the entries given), and reads
back its score files: the accuracy of each category and every entry BFCL failed. It is the
other side of the parity test (tests/envs/test_bfcl.py): what BFCL says about outputs when
nothing of ours stands between them and its runner.

Run in BFCL's own environment: `.venv-bfcl/bin/python -m envs.bfcl.bfcl_evaluate RESULTS.jsonl`
prints, for each `round` of the results (an entry appears at most once in a round, as in one
result file), `{"accuracy": {category: {...}}, "valid": {id: bool}}`. Standard library and
bfcl_eval.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from envs.bfcl.grader_server import MODEL, register_model


def evaluate(results: list[dict[str, Any]]) -> dict[str, Any]:
    """BFCL's verdict on every result and its accuracy per category."""
    register_model()
    from bfcl_eval.eval_checker import eval_runner
    from bfcl_eval.utils import extract_test_category_from_id

    by_category: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        by_category[extract_test_category_from_id(result["id"])].append(result)
    with tempfile.TemporaryDirectory(prefix="bfcl-evaluate-") as work:
        result_dir, score_dir = Path(work, "result"), Path(work, "score")
        model_dir = result_dir / MODEL
        model_dir.mkdir(parents=True)
        for category, entries in by_category.items():
            with open(model_dir / f"BFCL_v4_{category}_result.json", "w") as f:
                for entry in entries:
                    f.write(json.dumps({"id": entry["id"], "result": entry["result"]}) + "\n")
        with contextlib.redirect_stdout(None):  # its progress lines; the answer is the score files
            eval_runner.main([MODEL], list(by_category), result_dir, score_dir, partial_eval=True)
        accuracy, failed = {}, set()
        for path in (score_dir / MODEL).rglob("BFCL_v4_*_score.json"):
            category = path.name[len("BFCL_v4_"):-len("_score.json")]
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            accuracy[category] = lines[0]
            failed.update(line["id"] for line in lines[1:])
    return {"accuracy": accuracy, "valid": {r["id"]: r["id"] not in failed for r in results}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="JSONL of {round, id, result}")
    args = parser.parse_args()
    rounds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in args.results.read_text().splitlines():
        if line.strip():
            result = json.loads(line)
            rounds[str(result.get("round", ""))].append(result)
    print(json.dumps({name: evaluate(results) for name, results in rounds.items()}))


if __name__ == "__main__":
    main()
