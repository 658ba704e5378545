"""`POST /v1/files` as a stream: the multipart body parsed as it arrives, the file part
written to disk chunk by chunk (`files.Upload`), never held in memory whole.

The form is OpenAI's: a `purpose` field and a `file` part. A body whose declared length
is already past the limit is refused before it is read; one that crosses it while
streaming stops there. Whatever stops an upload (too large, not JSONL, a malformed form, a
client that hangs up) removes its partial file.
"""

from __future__ import annotations

from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from flows.openai_api.files import FileStore, FileTooLarge, Upload
from trainer.errors import DataError

_FORM_OVERHEAD = 64 * 1024  # boundaries, part headers and the purpose field around the file
_MAX_FIELD_BYTES = 1024  # a form field other than the file (purpose is a short word)


async def receive_upload(request: Any, store: FileStore) -> tuple[Upload, str | None]:
    """The file part, written to a partial file and checked, and the `purpose` field."""
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise DataError("the body must be multipart/form-data with a `file` part and a `purpose` field")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > store.max_bytes + _FORM_OVERHEAD:
        raise FileTooLarge(f"the upload declares {int(declared)} bytes, past this server's limit of "
                           f"{store.max_bytes} bytes (`agentrft api --max-file-bytes`); split the file or raise the limit")
    part: dict[str, Any] = {}
    fields: dict[str, bytearray] = {}
    uploads: list[Upload] = []

    def on_part_begin() -> None:
        part.clear()
        part["headers"] = {}
        part["field"], part["value"] = bytearray(), bytearray()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        part["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        part["value"] += data[start:end]

    def on_header_end() -> None:
        part["headers"][bytes(part["field"]).lower()] = bytes(part["value"])
        part["field"], part["value"] = bytearray(), bytearray()

    def on_headers_finished() -> None:
        _, disposition = parse_options_header(part["headers"].get(b"content-disposition", b""))
        part["name"] = disposition.get(b"name", b"").decode(errors="replace")
        if part["name"] == "file":
            if uploads:
                raise DataError("the form has two `file` parts; send one file an upload")
            filename = disposition.get(b"filename", b"upload.jsonl").decode(errors="replace") or "upload.jsonl"
            uploads.append(store.begin(filename))
        else:
            fields[part["name"]] = bytearray()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if part.get("name") == "file":
            uploads[-1].write(data[start:end])
            return
        value = fields.setdefault(part.get("name", ""), bytearray())
        value += data[start:end]
        if len(value) > _MAX_FIELD_BYTES:
            raise DataError(f"form field {part.get('name')!r} is longer than {_MAX_FIELD_BYTES} bytes")

    parser = MultipartParser(boundary, callbacks={
        "on_part_begin": on_part_begin, "on_header_field": on_header_field, "on_header_value": on_header_value,
        "on_header_end": on_header_end, "on_headers_finished": on_headers_finished, "on_part_data": on_part_data,
    })
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except BaseException as exc:
        for upload in uploads:
            upload.abort()
        if isinstance(exc, MultipartParseError):
            raise DataError(f"the multipart form is malformed ({exc})") from None
        raise
    if not uploads:
        raise DataError("file is required (multipart form field `file`)")
    purpose = fields.get("purpose")
    return uploads[0], purpose.decode(errors="replace") if purpose is not None else None
