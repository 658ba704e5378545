"""Load the real FinQA dataset (Chen et al., 2021) into the demo's corpus and item layout.

FinQA ships as JSON arrays (train.json, dev.json, test.json); each record is one report
page (`filename` like "ADI/2009/page_49.pdf", `pre_text` and `post_text` as lists of
sentences, `table` as rows of cells) with one question in `qa` (`question`, `program`,
`exe_ans`, usually `answer`). Loading writes the page as `corpus/reports/ADI/2009/page_49.txt`,
rendered exactly like the generated pages, and one item per record into
`<out_dir>/<split_name>.jsonl` in the generated items' shape, so the tool server, graders
and pipeline run unchanged on real data.

The category is inferred from the program's ops: none -> single_lookup, subtract ->
change, subtract then divide -> percent_change, divide -> ratio, anything else (several
steps, add, table ops) -> multi_year. FinQA's yes/no answers (`greater`) become 1.0/0.0.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from envs.finqa.generate import format_answer, render_page, write_jsonl
from envs.finqa.tool_schemas import TOOL_SCHEMAS
from trainer.errors import DataError

_OP = re.compile(r"([a-z_]+)\(")
_SAFE_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_PAGE = re.compile(r"page_(\d+)\.pdf")


def infer_category(program: str) -> str:
    """The question category a FinQA program belongs to, from its ops alone."""
    ops = _OP.findall(program)
    match ops:
        case []:
            return "single_lookup"
        case ["subtract"]:
            return "change"
        case ["subtract", "divide"]:
            return "percent_change"
        case ["divide"]:
            return "ratio"
        case _:
            return "multi_year"


def _is_rows(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(row, list) and all(isinstance(cell, str) for cell in row) for row in value
    )


# What each field of a record must be: a check and the words for the error message.
_KINDS = {
    "text": (lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string"),
    "lines": (
        lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
        "a list of strings",
    ),
    "rows": (_is_rows, "a list of rows, each a list of strings"),
    "object": (lambda v: isinstance(v, dict), "an object"),
}


def _field(record: dict, key: str, kind: str, where: str):
    """record[key] checked against its kind; a DataError names the record and the key."""
    if key not in record:
        raise DataError(f"{where}: missing key {key!r}")
    check, expected = _KINDS[kind]
    if not check(record[key]):
        raise DataError(f"{where}: {key!r} must be {expected}")
    return record[key]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _exe_ans(value: object, where: str) -> float:
    if isinstance(value, str) and value.strip().lower() in ("yes", "no"):
        return 1.0 if value.strip().lower() == "yes" else 0.0
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise DataError(
            f"{where}: 'qa.exe_ans' must be a number or yes/no, got {value!r}"
        ) from None


def _page_path(filename: str, where: str) -> tuple[str, str, int]:
    """'ADI/2009/page_49.pdf' -> ('reports/ADI/2009/page_49.txt', 'ADI', 2009). A ticker
    with a slash (BRK/B) becomes BRK.B so that each report stays one directory."""
    parts = filename.split("/")
    page = _PAGE.fullmatch(parts[-1]) if len(parts) >= 3 else None
    if (
        page is None
        or not parts[-2].isdigit()
        or not all(_SAFE_PART.fullmatch(p) for p in parts[:-2])
    ):
        raise DataError(
            f"{where}: 'filename' must look like 'TICKER/2009/page_49.pdf', got {filename!r}"
        )
    ticker = ".".join(parts[:-2])
    return f"reports/{ticker}/{parts[-2]}/page_{page.group(1)}.txt", ticker, int(parts[-2])


def load_finqa_json(path: Path, out_dir: Path, *, split_name: str) -> int:
    """Write the pages of a FinQA JSON file under out_dir/corpus and its items to
    out_dir/<split_name>.jsonl; return the number of items. Records are all checked before
    anything is written, so a bad file leaves out_dir as it was."""
    path, out_dir = Path(path), Path(out_dir)
    if not _SAFE_PART.fullmatch(split_name):
        raise DataError(f"split name {split_name!r}: use letters, digits, '.', '_' or '-'")
    if not path.is_file():
        raise DataError(f"{path}: FinQA JSON file not found")
    try:
        records = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a valid UTF-8 JSON file ({exc})") from None
    if not isinstance(records, list):
        raise DataError(
            f"{path}: expected a JSON array of FinQA records, got {type(records).__name__}"
        )

    pages: dict[str, str] = {}
    rows: list[dict] = []
    for index, record in enumerate(records):
        where = f"{path}: record {index}"
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected an object, got {type(record).__name__}")
        record_id = _field(record, "id", "text", where)
        where = f"{path}: record {index} (id {record_id!r})"
        page, ticker, year = _page_path(_field(record, "filename", "text", where), where)
        pre_text = _field(record, "pre_text", "lines", where)
        post_text = _field(record, "post_text", "lines", where)
        table = _field(record, "table", "rows", where)
        qa = _field(record, "qa", "object", where)
        question = _field(qa, "question", "text", f"{where}: 'qa'")
        program = _field(qa, "program", "text", f"{where}: 'qa'")
        if "exe_ans" not in qa:
            raise DataError(f"{where}: 'qa': missing key 'exe_ans'")
        exe_ans = _exe_ans(qa["exe_ans"], where)
        # FinQA's own answer string when given ("14.1%"), else yes/no as written, else the number.
        answer = qa.get("answer")
        if isinstance(answer, str) and answer.strip():
            reference = answer.strip()
        elif isinstance(qa["exe_ans"], str) and not _is_number(qa["exe_ans"]):
            reference = qa["exe_ans"].strip().lower()
        else:
            reference = format_answer(exe_ans, percent=False)
        pages[page] = render_page(
            [s.strip() for s in pre_text], table, [s.strip() for s in post_text]
        )
        rows.append(
            {
                "id": record_id,
                "messages": [{"role": "user", "content": question}],
                "tools": TOOL_SCHEMAS,
                "question": question,
                "reference_answer": reference,
                "exe_ans": exe_ans,
                "program": program,
                "category": infer_category(program),
                "ticker": ticker,
                "year": year,
                "gold_pages": [page],
            }
        )

    for page, text in pages.items():
        file = out_dir / "corpus" / page
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text, encoding="utf-8", newline="\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / f"{split_name}.jsonl", rows)
    return len(rows)
