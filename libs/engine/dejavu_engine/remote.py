"""A stage's share of a checkpoint, fetched from a weight source (:mod:`dejavu_engine.weight_source`).

A worker with ``model.source_url`` set and no local copy fetches, when it loads a stage, only what that stage
reads: the folder's small files (config, tokenizer, generation config, chat template), each weight file's header,
and the bytes of the tensors of its layers (with the embedding on a first stage, the final norm and head on a
last one, and the ``_scale`` of each int8 tensor). It writes them, as stored (GGUF blocks and int8 tensors are
never converted), into a partial checkpoint folder under ``model.cache_dir/remote``: the same header indexing
only those tensors (:mod:`dejavu_engine.weight_index`), which :class:`~dejavu_engine.stage.Stage` then loads
through :class:`~dejavu_engine.weights.CheckpointReader` like any folder.

The folder's name is a hash of the source URL, the name, size and entity tag of every file fetched from, and the
layer range, so a restarted worker reuses it (after fetching the source's manifest) and a changed source is
fetched anew. It is written into a private sibling folder and renamed into place, so a killed fetch leaves
nothing half-written; two workers fetching the same share at once both end with the one that was renamed first.

Every request has a deadline (``model.source_deadline_s``, the whole answer included); a failed range (no
answer, a 5xx, a body of the wrong length or whose ``Content-Digest`` does not match, a file whose entity tag
changed) is retried ``model.source_retries`` times with backoff, then fails the load with
:class:`~dejavu_engine.checkpoint.CheckpointError` naming the source and what went wrong. A refused token (401),
an unknown file (404) and a refused range fail at once.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import CheckpointError
from dejavu_engine.weight_index import GGUF_MAGIC, Piece, ShortHeader, WeightIndex, WeightIndexError, parse_index

log = logging.getLogger(__name__)

CHUNK = 16 << 20  # the most bytes one range request asks for (and the client holds at once)
GAP = 4 << 10  # tensors this close in the weight file are fetched in one range, the gap with them
FIRST_HEADER_READ = 16 << 10  # bytes of a weight file read first for its header (more where it is longer)
BACKOFF_S = (0.2, 2.0)  # first retry's wait, and the longest
SHARES = "remote"  # the folder under model.cache_dir holding fetched shares
_SMALL_FILE = re.compile(r"(tokenizer.*|.*\.json|.*\.jinja|.*\.txt)")  # the small files a share copies whole


class SourceError(CheckpointError):
    """The weight source refused, failed or answered wrongly."""


class _Retryable(SourceError):
    """A failure that another try of the same request may not meet."""


@dataclass
class WeightSource:
    """A weight source's URL, its token, each request's deadline and the retries of a failed request."""

    url: str
    token: str
    deadline_s: float = 30.0
    retries: int = 3
    fetched_bytes: int = field(default=0, init=False)  # file bytes received (headers and tensors)

    @classmethod
    def of(cls, settings: Settings) -> WeightSource:
        """The source ``settings.model`` names; CheckpointError without a URL or a token."""
        model = settings.model
        if not model.source_url:
            raise CheckpointError("model.source_url is not set")
        if model.source_token is None or not model.source_token.get_secret_value():
            raise CheckpointError("model.source_url is set but model.source_token is not")
        return cls(
            model.source_url, model.source_token.get_secret_value(), model.source_deadline_s, model.source_retries
        )


def resolve_model_folder(settings: Settings, layers: tuple[int, int]) -> Path:
    """The checkpoint folder a stage of global layers ``[first, last)`` loads: ``model.folder``, or, where
    ``model.source_url`` is set, its share fetched from that source (:func:`fetch_share`)."""
    if not settings.model.source_url:
        return settings.model.folder
    return fetch_share(WeightSource.of(settings), layers, settings.model.cache_dir / SHARES)


def fetch_share(source: WeightSource, layers: tuple[int, int], root: Path) -> Path:
    """The folder under ``root`` holding the share of layers ``[first, last)`` of ``source``'s checkpoint,
    fetched unless already there. Raises :class:`SourceError` for a source that fails or answers wrongly,
    CheckpointError for a checkpoint without the stage's tensors, ValueError for an unsupported family or a layer
    range outside the model."""
    with _client(source) as client:
        files = _manifest(client, source)
        weights = _weight_files(files)
        small = sorted(name for name in files if _SMALL_FILE.fullmatch(name))
        if "config.json" not in small:
            raise CheckpointError(f"{source.url} serves no config.json")
        identity = [source.url, [files[n] for n in sorted({*small, *weights})], list(layers)]
        key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
        target = root / f"layers-{layers[0]}-{layers[1]}-{key}"
        with _locked(root / f"{target.name}.lock"):
            if target.is_dir():
                log.info("weights of layers %s: the share fetched before, %s", layers, target)
                return target
            with _publishing(target) as staging:
                _fetch_into(client, source, layers, [files[n] for n in small], [files[n] for n in weights], staging)
    return target


def _manifest(client: httpx.Client, source: WeightSource) -> dict[str, dict[str, Any]]:
    """The source's files by name (each with its ``size`` and ``etag``); SourceError for a malformed manifest."""
    answer = _json(client, source, "/v1/manifest")
    files = answer.get("files") if isinstance(answer, dict) else None
    if not isinstance(files, list) or not all(
        isinstance(f, dict)
        and isinstance(f.get("name"), str)
        and isinstance(f.get("size"), int)
        and f["size"] >= 0
        and isinstance(f.get("etag"), str)
        for f in files
    ):
        raise SourceError(f"weight source {source.url}: its manifest is not a list of files (name, size, etag)")
    return {f["name"]: f for f in files}


def _fetch_into(
    client: httpx.Client,
    source: WeightSource,
    layers: tuple[int, int],
    small: list[dict[str, Any]],
    weights: list[dict[str, Any]],
    folder: Path,
) -> None:
    """Write the share of ``layers`` into ``folder``: the ``small`` files whole, the ``weights`` files' tensors that
    the stage loads."""
    for file in small:
        _fetch_whole(client, source, file, folder / file["name"])
    wanted = _stage_names(json.loads((folder / "config.json").read_text()), layers)
    indexes = {file["name"]: _index(client, source, file) for file in weights}
    by_name = {file["name"]: file for file in weights}
    for name, stored in _stored_names(indexes, wanted).items():
        _fetch_tensors(client, source, by_name[name], indexes[name], stored, folder / name)
    log.info(
        "weights of layers %s: %.1f MB of %.1f MB fetched from %s",
        layers,
        source.fetched_bytes / 1e6,
        sum(file["size"] for file in weights) / 1e6,
        source.url,
    )


def _weight_files(files: dict[str, Any]) -> list[str]:
    """The weight files a share reads, as CheckpointReader chooses: every ``*.safetensors``, else one ``*.gguf``."""
    safetensors = sorted(name for name in files if name.endswith(".safetensors"))
    ggufs = sorted(name for name in files if name.endswith(".gguf"))
    if safetensors:
        return safetensors
    if len(ggufs) == 1:
        return ggufs
    raise CheckpointError(f"the source serves no *.safetensors files (nor one *.gguf file): {sorted(files)}")


def _stage_names(config: dict[str, Any], layers: tuple[int, int]) -> list[str]:
    """The checkpoint names a stage of ``layers`` loads (as :class:`~dejavu_engine.stage.Stage` does)."""
    from dejavu_engine.families import family_for

    family = family_for(config)
    first, last = layers
    if not 0 <= first < last <= family.spec.num_layers:
        raise ValueError(f"layer range {layers} not within [0, {family.spec.num_layers}) or empty")
    names = [name for i in range(first, last) for name in family.layer_names(i).values()]
    if first == 0:
        names += family.embedding_names().values()
    if last == family.spec.num_layers:
        names += family.head_names().values()
    return list(dict.fromkeys(names))


def _stored_names(indexes: dict[str, WeightIndex], wanted: Iterable[str]) -> dict[str, list[str]]:
    """Weight file -> the stored names of ``wanted`` in it (a name also found without its first component, as
    CheckpointReader looks it up, and an int8 tensor with its ``_scale``). CheckpointError for a missing one."""
    file_of: dict[str, str] = {}
    for file, index in indexes.items():
        for stored in index.tensors:
            file_of[_checkpoint_name(index, stored)] = file
    by_file: dict[str, list[str]] = {}
    stored_of = {_checkpoint_name(index, stored): stored for index in indexes.values() for stored in index.tensors}
    for name in wanted:
        short = name.partition(".")[2]
        found = name if name in file_of else short if short in file_of else None
        if found is None:
            raise CheckpointError(f"tensor {name!r} not found in the checkpoint")
        for each in (found, f"{found}_scale"):
            if each in file_of:
                by_file.setdefault(file_of[each], []).append(stored_of[each])
    return by_file


def _checkpoint_name(index: WeightIndex, stored: str) -> str:
    """The name CheckpointReader knows a stored tensor by (a GGUF tensor's Hugging Face name)."""
    if index.kind == "gguf":
        from dejavu_engine.gguf_file import _hf_name

        return _hf_name(stored)
    return stored


def _index(client: httpx.Client, source: WeightSource, file: dict[str, Any]) -> WeightIndex:
    """The index of a weight file from its first bytes (read again, longer, where the header is longer)."""
    size = int(file["size"])
    prefix = b""
    want = min(FIRST_HEADER_READ, size)
    while True:
        if want > len(prefix):
            prefix += _fetch_range(client, source, file, len(prefix), want)
        try:
            return parse_index(prefix, size)
        except ShortHeader as short:
            if short.needed > size:
                raise SourceError(f"{file['name']} from {source.url}: its header runs past its end") from None
            # safetensors names its header's length; a GGUF header is known field by field: read it doubling
            want = min(max(short.needed, 2 * len(prefix) if prefix[:4] == GGUF_MAGIC else 0), size)
        except WeightIndexError as exc:
            raise CheckpointError(f"{file['name']} from {source.url}: {exc}") from exc


def _fetch_tensors(
    client: httpx.Client,
    source: WeightSource,
    file: dict[str, Any],
    index: WeightIndex,
    stored: list[str],
    target: Path,
) -> None:
    """Write the file of ``stored`` tensors of a weight file at ``target``: its header, then each range."""
    layout = index.subset(stored)
    with target.open("wb") as out:
        out.write(layout.header)
        out.truncate(layout.size)
        for span in _spans(layout.pieces):
            start, end = span[0].source, span[-1].source + span[-1].size
            data = _fetch_range(client, source, file, start, end)
            for piece in span:
                out.seek(piece.target)
                out.write(data[piece.source - start : piece.source - start + piece.size])
        out.flush()
        os.fsync(out.fileno())


def _spans(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    """Pieces in runs fetched as one range each: within :data:`GAP` of each other, :data:`CHUNK` bytes at most
    (a longer piece split)."""
    run: list[Piece] = []
    for whole in pieces:
        for at in range(0, whole.size, CHUNK):
            piece = Piece(whole.source + at, whole.target + at, min(CHUNK, whole.size - at))
            if run and (
                piece.source - (run[-1].source + run[-1].size) > GAP
                or piece.source + piece.size - run[0].source > CHUNK
            ):
                yield run
                run = []
            run.append(piece)
    if run:
        yield run


def _fetch_whole(client: httpx.Client, source: WeightSource, file: dict[str, Any], target: Path) -> None:
    target.write_bytes(_fetch_range(client, source, file, 0, int(file["size"])) if file["size"] else b"")


def _fetch_range(client: httpx.Client, source: WeightSource, file: dict[str, Any], start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a served file, checked (length, digest, entity tag) and retried."""
    name = file["name"]
    headers = {"Range": f"bytes={start}-{end - 1}"}

    def once() -> bytes:
        began = time.monotonic()
        path = f"/v1/files/{quote(name, safe='')}"
        with _deadline(source), client.stream("GET", path, headers=headers) as answer:
            _check_status(answer, source)
            if answer.headers.get("etag") != file["etag"]:
                raise _Retryable(f"{name} changed on the source while it was fetched")
            body = bytearray()
            for data in answer.iter_raw():
                body += data
                if len(body) > end - start:
                    break
                if time.monotonic() - began > source.deadline_s:
                    raise _Retryable(f"{name} bytes {start}-{end}: not received within {source.deadline_s} s")
        if len(body) != end - start:
            raise _Retryable(f"{name} bytes {start}-{end}: {len(body)} bytes received, not {end - start}")
        digest = answer.headers.get("content-digest")
        if digest is not None and digest != digest_header(bytes(body)):
            raise _Retryable(f"{name} bytes {start}-{end}: the bytes do not match their Content-Digest")
        source.fetched_bytes += len(body)
        return bytes(body)

    return _retried(source, once)


def digest_header(data: bytes) -> str:
    """The ``Content-Digest`` a weight source sends with ``data`` (RFC 9530's sha-256 form)."""
    return f"sha-256=:{base64.b64encode(hashlib.sha256(data).digest()).decode()}:"


def _json(client: httpx.Client, source: WeightSource, path: str) -> dict[str, Any]:
    def once() -> dict[str, Any]:
        with _deadline(source):
            answer = client.get(path)
        _check_status(answer, source)
        try:
            return answer.json()
        except ValueError as exc:
            raise _Retryable(f"{path}: not JSON") from exc

    return _retried(source, once)


def _retried(source: WeightSource, once: Any) -> Any:
    """``once()``, tried again after a retryable failure up to ``source.retries`` times, with backoff."""
    for attempt in range(source.retries + 1):
        try:
            return once()
        except _Retryable as exc:
            if attempt == source.retries:
                raise SourceError(f"weight source {source.url}: {exc} (after {attempt + 1} tries)") from exc
            wait = min(BACKOFF_S[0] * 2**attempt, BACKOFF_S[1])
            log.warning("weight source %s: %s; trying again in %.1f s", source.url, exc, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _check_status(answer: httpx.Response, source: WeightSource) -> None:
    code = answer.status_code
    if code in (200, 206):
        return
    if code == 401 or code == 403:
        raise SourceError(f"weight source {source.url} refused the token (HTTP {code}): check model.source_token")
    if code >= 500 or code == 429:
        raise _Retryable(f"HTTP {code} for {answer.request.url.path}")
    raise SourceError(f"weight source {source.url}: HTTP {code} for {answer.request.url.path}")


@contextlib.contextmanager
def _deadline(source: WeightSource) -> Iterator[None]:
    """Network failures of one request as retryable errors that name the source."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise _Retryable(f"no answer within the deadline of {source.deadline_s} s ({type(exc).__name__})") from exc
    except httpx.ConnectError as exc:
        raise _Retryable(f"unreachable ({exc})") from exc
    except httpx.TransportError as exc:
        raise _Retryable(f"request failed ({type(exc).__name__}: {exc})") from exc


def _client(source: WeightSource) -> httpx.Client:
    return httpx.Client(
        base_url=source.url.rstrip("/"),
        headers={"Authorization": f"Bearer {source.token}", "Accept-Encoding": "identity"},
        timeout=httpx.Timeout(source.deadline_s),
        follow_redirects=False,
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if needed; released when the block ends or the process dies), so
    that workers on one host fetching one share take turns and the later ones reuse it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _publishing(target: Path) -> Iterator[Path]:
    """A private sibling folder to write ``target`` into, renamed into place when the block succeeds (where
    another process renamed its own first, that one stays) and removed whatever happens."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staging
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
