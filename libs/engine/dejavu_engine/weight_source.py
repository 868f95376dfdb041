"""A weight source: one prepared checkpoint folder served read-only over HTTP (``dejavu model serve``).

Workers configured with ``model.source_url`` fetch their stage's share from it (:mod:`dejavu_engine.remote`).
Every route but ``/healthz`` needs ``Authorization: Bearer <token>`` (compared in constant time). Routes:

* ``GET /v1/manifest``: ``{"files": [{"name", "size", "etag"}]}``, the folder's top-level regular files (a
  symlink the folder holds is served as the file it names; hidden files and subfolders are not served);
* ``GET /v1/files/{name}``: one of those files, whole or one byte range (``Range: bytes=a-b``, answered 206
  with ``Content-Range``). A name outside the manifest (``..``, a path, a hidden file) is 404.

Every file answer carries the file's ``ETag`` (size and modification time: a worker notices a file replaced
while it fetches) and ``Content-Digest: sha-256=:<base64>:`` of exactly the bytes sent (RFC 9530), computed by
reading the range once before streaming it; bodies stream in :data:`CHUNK` reads, so no file is held in memory.
``app.state.bytes_sent`` counts the file bytes streamed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # bytes a read while hashing or streaming a file
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass(frozen=True)
class FileInfo:
    """A served file: its name in the folder, size and entity tag."""

    name: str
    path: Path
    size: int
    etag: str


def folder_files(folder: Path) -> dict[str, FileInfo]:
    """The files a source serves from ``folder``: its top-level regular files (symlinks followed), not hidden."""
    files: dict[str, FileInfo] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        stat = path.stat()
        files[path.name] = FileInfo(path.name, path, stat.st_size, f'"{stat.st_size:x}-{stat.st_mtime_ns:x}"')
    return files


def create_app(folder: Path, token: str) -> Starlette:
    """The source's app over ``folder``, answering only requests that bear ``token``. Raises ValueError for an
    empty token or a folder that does not exist."""
    if not token:
        raise ValueError("a weight source needs a token (model.source_token)")
    if not folder.is_dir():
        raise ValueError(f"not a folder: {folder}")
    expected = f"Bearer {token}".encode()

    def authorized(request: Request) -> bool:
        return hmac.compare_digest(request.headers.get("authorization", "").encode(), expected)

    def refused() -> Response:
        return PlainTextResponse("a valid bearer token is required", 401, headers={"WWW-Authenticate": "Bearer"})

    async def manifest(request: Request) -> Response:
        if not authorized(request):
            return refused()
        files = await run_in_threadpool(folder_files, folder)
        return JSONResponse({"files": [{"name": f.name, "size": f.size, "etag": f.etag} for f in files.values()]})

    async def file(request: Request) -> Response:
        if not authorized(request):
            return refused()
        info = (await run_in_threadpool(folder_files, folder)).get(request.path_params["name"])
        if info is None:
            return PlainTextResponse("no such file in the checkpoint folder", 404)
        span = _span(request.headers.get("range"), info.size)
        if span is None:
            return PlainTextResponse(
                f"one satisfiable byte range of {info.size} bytes is served",
                416,
                headers={"Content-Range": f"bytes */{info.size}"},
            )
        start, end = span
        digest = await run_in_threadpool(_range_digest, info.path, start, end)
        headers = {
            "ETag": info.etag,
            "Content-Digest": digest,
            "Content-Length": str(end - start),
            "Accept-Ranges": "bytes",
        }
        status = 200
        if "range" in request.headers:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{info.size}"
        return StreamingResponse(
            _stream(app, info.path, start, end), status, headers=headers, media_type="application/octet-stream"
        )

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(
        routes=[
            Route("/v1/manifest", manifest),
            Route("/v1/files/{name}", file),
            Route("/healthz", healthz),
        ]
    )
    app.state.bytes_sent = 0
    app.state.count_lock = threading.Lock()  # streams run in the threadpool
    return app


def _span(header: str | None, size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a ``Range`` header over a file of ``size`` bytes (the whole file without one); None
    for several ranges, a malformed one or one past the end."""
    if header is None:
        return 0, size
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if not first:  # a suffix: the last `last` bytes
        if not last or int(last) == 0:
            return None
        return max(size - int(last), 0), size
    start = int(first)
    end = min(int(last) + 1, size) if last else size
    if start >= size or end <= start:
        return None
    return start, end


def _chunks(path: Path, start: int, end: int) -> Iterator[bytes]:
    with path.open("rb") as handle:
        handle.seek(start)
        left = end - start
        while left > 0:
            data = handle.read(min(CHUNK, left))
            if not data:
                raise OSError(f"{path.name} ended {left} bytes before the range did")
            left -= len(data)
            yield data


def _range_digest(path: Path, start: int, end: int) -> str:
    sha = hashlib.sha256()
    for data in _chunks(path, start, end):
        sha.update(data)
    return f"sha-256=:{base64.b64encode(sha.digest()).decode()}:"  # RFC 9530 (remote.digest_header's form)


def _stream(app: Starlette, path: Path, start: int, end: int) -> Iterator[bytes]:
    for data in _chunks(path, start, end):
        with app.state.count_lock:
            app.state.bytes_sent += len(data)
        yield data


def serve(folder: Path, token: str, host: str, port: int, log_level: str = "info") -> None:
    """Serve ``folder`` on ``host:port`` until interrupted (uvicorn)."""
    import uvicorn

    log.info("serving %s on %s:%d", folder, host, port)
    uvicorn.run(create_app(folder, token), host=host, port=port, log_level=log_level.lower())
