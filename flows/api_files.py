"""The Files part of the fine-tuning API: uploads stored under the work directory.

A file's bytes live once, named by their sha256 (`blobs/<sha256>`), however many times
they are uploaded; each upload gets its own OpenAI-style id (`file-...`) and a small JSON
record beside the blobs. An upload must be JSONL (each non-blank line one JSON object,
UTF-8): a file that is not is refused at upload with the line that breaks it, and nothing
is stored. Accepted files are `processed` at once; the RFT content checks (messages,
tools, the grader's `{{item.*}}` fields) run in a job's `validating_files` step, where
the grader is known.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

from trainer.data import read_numbered
from trainer.errors import DataError

PURPOSES = ("fine-tune",)


class FileStore:
    """Uploaded files: records (`<id>.json`) and content-addressed blobs."""

    def __init__(self, root: Path):
        self.root = root
        self.blobs = root / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)

    def add(self, filename: str, content: bytes, purpose: str) -> dict[str, Any]:
        """Store an upload; DataError (naming the line) when it is not JSONL."""
        digest = hashlib.sha256(content).hexdigest()
        blob = self.blobs / digest
        if not blob.exists():
            partial = blob.with_suffix(".partial")
            partial.write_bytes(content)
            try:
                rows = read_numbered(partial)
            except DataError as exc:
                partial.unlink()
                raise DataError(str(exc).replace(str(partial), filename, 1)) from None
            if not rows:
                partial.unlink()
                raise DataError(f"{filename}: no JSON lines; a fine-tuning file has one JSON object a line")
            partial.replace(blob)
        record = {"id": f"file-{uuid.uuid4().hex[:24]}", "object": "file", "bytes": len(content),
                  "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                  "status": "processed", "status_details": None, "expires_at": None, "sha256": digest}
        (self.root / f"{record['id']}.json").write_text(json.dumps(record))
        return record

    def get(self, file_id: str) -> dict[str, Any] | None:
        path = self.root / f"{file_id}.json"
        if not file_id.startswith("file-") or not path.is_file():
            return None
        return json.loads(path.read_text())

    def path(self, record: dict[str, Any]) -> Path:
        return self.blobs / record["sha256"]

    def list(self) -> list[dict[str, Any]]:
        """Every file, newest first (ties by id, so paging with `after` is stable)."""
        records = [json.loads(p.read_text()) for p in self.root.glob("file-*.json")]
        return sorted(records, key=lambda r: (-r["created_at"], r["id"]))

    def delete(self, file_id: str) -> bool:
        record = self.get(file_id)
        if record is None:
            return False
        (self.root / f"{file_id}.json").unlink()
        if not any(r["sha256"] == record["sha256"] for r in self.list()):
            self.path(record).unlink(missing_ok=True)
        return True


def public(record: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI file object (without our blob digest)."""
    return {k: v for k, v in record.items() if k != "sha256"}
