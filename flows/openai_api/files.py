"""The Files part of the fine-tuning API: uploads stored under the work directory.

A file's bytes live once, named by their sha256 (`blobs/<sha256>`), however many times
they are uploaded; each upload gets its own OpenAI-style id (`file-...`) and a small JSON
record beside the blobs. An upload must be JSONL (each non-blank line one JSON object,
UTF-8): a file that is not is refused at upload with the line that breaks it, and nothing
is stored. Accepted files are `processed` at once; the RFT content checks (messages,
tools, the grader's `{{item.*}}` fields) run in a job's `validating_files` step, where
the grader is known.

Uploads stream to disk (`Upload`): each chunk is hashed, written to a partial file and
checked line by line as it arrives, so the server holds a chunk and at most one line
(`MAX_LINE_BYTES`) whatever the file's size. A file past `max_bytes` (OpenAI's 512 MB by
default) stops at the chunk that crosses it; a refused upload leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from trainer.errors import DataError

PURPOSES = ("fine-tune",)
MAX_FILE_BYTES = 512 * 1024 * 1024  # OpenAI's limit for a fine-tuning file
MAX_LINE_BYTES = 8 * 1024 * 1024  # one example: what a line may hold before the upload is refused


class FileTooLarge(DataError):
    """An upload past the server's `max_bytes`."""


class Upload:
    """One file arriving in chunks: hashed, written and checked as JSONL while it streams."""

    def __init__(self, blobs: Path, filename: str, max_bytes: int):
        self.filename = filename
        self.max_bytes = max_bytes
        self.size = 0
        self.rows = 0
        self._line = 1
        self._pending = bytearray()  # the current line's bytes, until its newline arrives
        self._digest = hashlib.sha256()
        self.partial = blobs / f"incoming-{uuid.uuid4().hex}.partial"
        self._file = self.partial.open("wb")

    def write(self, chunk: bytes) -> None:
        """Take the next chunk; DataError (naming the line) as soon as the file cannot be JSONL,
        FileTooLarge as soon as it passes `max_bytes`."""
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise FileTooLarge(f"{self.filename}: larger than this server's limit of {self.max_bytes} bytes "
                               "(`agentrft api --max-file-bytes`); split the file or raise the limit")
        self._digest.update(chunk)
        self._file.write(chunk)
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            self._pending += chunk[start:end]
            self._check_line()
            start = end + 1
        self._pending += chunk[start:]
        if len(self._pending) > MAX_LINE_BYTES:
            raise DataError(f"{self.filename}:{self._line}: the line is longer than {MAX_LINE_BYTES} bytes; one "
                            "example a line, each under that size")

    def _check_line(self) -> None:
        raw = bytes(self._pending)
        self._pending.clear()
        number, self._line = self._line, self._line + 1
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{self.filename}:{number}: invalid UTF-8 at byte {exc.start} of the line; re-encode the "
                            "file as UTF-8") from None
        if not text.strip():
            return
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{self.filename}:{number}: invalid JSON ({exc.msg} at column {exc.colno}); each line "
                            "must be one JSON object") from None
        if not isinstance(row, dict):
            raise DataError(f"{self.filename}:{number}: expected a JSON object, got {type(row).__name__}")
        self.rows += 1

    def finish(self) -> str:
        """Check the last line and close; returns the sha256 of the content."""
        if self._pending:
            self._check_line()
        self._file.close()
        if not self.rows:
            raise DataError(f"{self.filename}: no JSON lines; a fine-tuning file has one JSON object a line")
        return self._digest.hexdigest()

    def abort(self) -> None:
        self._file.close()
        self.partial.unlink(missing_ok=True)


class FileStore:
    """Uploaded files: records (`<id>.json`) and content-addressed blobs."""

    def __init__(self, root: Path, *, max_bytes: int = MAX_FILE_BYTES):
        self.root = root
        self.max_bytes = max_bytes
        self.blobs = root / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        for stale in self.blobs.glob("incoming-*.partial"):  # uploads a killed server left half-written
            stale.unlink(missing_ok=True)

    def begin(self, filename: str) -> Upload:
        return Upload(self.blobs, filename, self.max_bytes)

    def commit(self, upload: Upload, purpose: str) -> dict[str, Any]:
        """Keep a finished upload under its digest and give it an id; the partial file goes
        either way."""
        try:
            digest = upload.finish()
        except BaseException:
            upload.abort()
            raise
        blob = self.blobs / digest
        if blob.exists():
            upload.partial.unlink()
        else:
            os.replace(upload.partial, blob)
        record = {"id": f"file-{uuid.uuid4().hex[:24]}", "object": "file", "bytes": upload.size,
                  "created_at": int(time.time()), "filename": upload.filename, "purpose": purpose,
                  "status": "processed", "status_details": None, "expires_at": None, "sha256": digest}
        (self.root / f"{record['id']}.json").write_text(json.dumps(record))
        return record

    def add(self, filename: str, content: bytes, purpose: str) -> dict[str, Any]:
        """Store an upload given whole; DataError (naming the line) when it is not JSONL."""
        upload = self.begin(filename)
        try:
            upload.write(content)
        except BaseException:
            upload.abort()
            raise
        return self.commit(upload, purpose)

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
