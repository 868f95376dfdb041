"""Weights over the network: a weight source (``dejavu model serve``) and the stage shares workers fetch from it.

Each share is checked against the stage loaded from the served folder itself (the same outputs bit for bit, the
same quantized weights), and the source's own count of the bytes it sent against the weight file's size.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from starlette.applications import Starlette

from dejavu_common.settings import Settings
from dejavu_engine import weight_source
from dejavu_engine.checkpoint import CheckpointError, find_default_gguf, quantize_checkpoint
from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.quant import QuantizedWeight
from dejavu_engine.remote import SourceError, WeightSource, fetch_share, resolve_model_folder
from dejavu_engine.stage import Stage
from dejavu_engine.stage_io import StageIO
from dejavu_engine.weight_index import ShortHeader, parse_index
from engine.tiny_models import build_checkpoint
from engine.weight_sources import TOKEN, serving

SPLIT = [(0, 2), (2, 4), (4, 6)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama of 6 layers (float32 safetensors, tokenizer, chat template)."""
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama") / "llama", overrides={"num_hidden_layers": 6})


@pytest.fixture(scope="module")
def llama_int8(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same Llama quantized to int8 per output channel (``dejavu model prepare --weights int8``'s format)."""
    target = tmp_path_factory.mktemp("int8") / "llama-int8"
    quantize_checkpoint(llama, target)
    return target


@pytest.fixture(scope="module")
def gguf_folder(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's config and tokenizer beside its GGUF file as published (Q4_1 blocks)."""
    folder = tmp_path_factory.mktemp("gguf")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(smollm2 / name, folder / name)
    (folder / "model.gguf").symlink_to(find_default_gguf())
    return folder


def _same_outputs(local: Stage, fetched: Stage, io: StageIO) -> StageIO:
    """Prefill ``io`` (6 positions) and decode one step through both stages; assert equal outputs; return the
    local prefill's output (the next stage's input)."""
    outputs = []
    for stage in (local, fetched):
        cache = stage.allocate_cache(1, 8)
        prefill = stage.forward(io, cache, BatchGeometry((0,), 6))
        step_in = StageIO(input_ids=torch.tensor([[7]]))
        if not stage.is_first:
            step_in = StageIO(hidden=torch.linspace(-1, 1, stage.spec.hidden_size).view(1, 1, -1))
        step = stage.forward(step_in, cache, BatchGeometry((0,), 7))
        outputs.append((prefill, step))
    (prefill, step), (other_prefill, other_step) = outputs
    for a, b in ((prefill, other_prefill), (step, other_step)):
        assert a.logits is None or torch.equal(a.logits, b.logits)
        assert a.hidden is None or torch.equal(a.hidden, b.hidden)
    return outputs[0][0]


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_each_stage_of_a_fetched_split_computes_what_the_local_stage_computes(
    quantized: bool, llama: Path, llama_int8: Path, tmp_path: Path
) -> None:
    folder = llama_int8 if quantized else llama
    with serving(folder) as (url, _app):
        source = WeightSource(url, TOKEN)
        shares = [fetch_share(source, layers, tmp_path) for layers in SPLIT]
    io = StageIO(input_ids=torch.tensor([[1, 5, 9, 42, 100, 7]]))
    for layers, share in zip(SPLIT, shares, strict=True):
        local, fetched = Stage(folder, layers), Stage(share, layers)
        assert local.weights.keys() == fetched.weights.keys()
        for name, weight in local.weights.items():
            assert type(fetched.weights[name]) is type(weight), name
            if isinstance(weight, QuantizedWeight):
                assert torch.equal(fetched.weights[name].q, weight.q) and torch.equal(
                    fetched.weights[name].scale, weight.scale
                )
        out = _same_outputs(local, fetched, io)
        io = StageIO(hidden=out.hidden) if out.hidden is not None else io


def test_a_middle_stage_fetches_its_layers_and_no_more(llama: Path, tmp_path: Path) -> None:
    with serving(llama) as (url, app):
        share = fetch_share(WeightSource(url, TOKEN), (2, 4), tmp_path)
        sent = app.state.bytes_sent
    size = (llama / "model.safetensors").stat().st_size
    with safe_open(str(share / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert names and all(name.startswith(("model.layers.2.", "model.layers.3.")) for name in names)
    with safe_open(str(llama / "model.safetensors"), framework="pt") as handle:
        stage_bytes = sum(handle.get_tensor(n).numel() * 4 for n in names)
    # its two layers of six, and the header; not the embedding, the head nor the other layers
    assert stage_bytes <= sent < stage_bytes + 32 * 1024 and sent < 0.4 * size
    assert {p.name for p in share.iterdir()} >= {"config.json", "tokenizer.json", "tokenizer_config.json"}


def test_a_fetched_gguf_share_keeps_the_published_blocks(gguf_folder: Path, tmp_path: Path) -> None:
    with serving(gguf_folder) as (url, app):
        share = fetch_share(WeightSource(url, TOKEN), (10, 20), tmp_path)
        sent = app.state.bytes_sent
    local, fetched = Stage(gguf_folder, (10, 20)), Stage(share, (10, 20))
    quantized = [name for name, w in local.weights.items() if isinstance(w, QuantizedWeight)]
    assert quantized and fetched.param_bytes == local.param_bytes
    for name in quantized:
        mine, theirs = fetched.weights[name], local.weights[name]
        assert isinstance(mine, QuantizedWeight) and mine.kind == theirs.kind == "Q4_1"
        assert torch.equal(mine.q, theirs.q) and torch.equal(mine.scale, theirs.scale)
    size = find_default_gguf().stat().st_size
    assert (share / "model.gguf").stat().st_size < 0.45 * size and sent < 0.45 * size  # 10 layers of 30
    torch.manual_seed(0)
    _same_outputs(local, fetched, StageIO(hidden=torch.randn(1, 6, local.spec.hidden_size)))


def test_a_share_is_reused_after_a_restart_and_fetched_again_when_the_source_changes(
    llama: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "served"
    shutil.copytree(llama, folder)
    with serving(folder) as (url, app):
        first = fetch_share(WeightSource(url, TOKEN), (2, 4), tmp_path / "cache")
        sent = app.state.bytes_sent
        assert fetch_share(WeightSource(url, TOKEN), (2, 4), tmp_path / "cache") == first
        assert app.state.bytes_sent == sent  # nothing fetched again
        os.utime(folder / "model.safetensors", ns=(1, 1))  # another file (its entity tag) on the source
        again = fetch_share(WeightSource(url, TOKEN), (2, 4), tmp_path / "cache")
        assert again != first and app.state.bytes_sent > sent
    assert {p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()} == {first.name, again.name}  # no staging


def test_resolve_model_folder_fetches_only_where_a_source_is_set(llama: Path, tmp_path: Path) -> None:
    local = Settings(model={"path": llama, "cache_dir": tmp_path})
    assert resolve_model_folder(local, (0, 2)) == llama
    with serving(llama) as (url, _app):
        remote = Settings(model={"source_url": url, "source_token": TOKEN, "cache_dir": tmp_path})
        share = resolve_model_folder(remote, (0, 2))
        assert share.parent == tmp_path / "remote" and (share / "model.safetensors").is_file()
        with pytest.raises(CheckpointError, match=r"model\.source_token"):
            resolve_model_folder(Settings(model={"source_url": url, "cache_dir": tmp_path}), (0, 2))


def test_a_wrong_token_is_refused_with_a_clear_error(llama: Path, tmp_path: Path) -> None:
    with serving(llama) as (url, _app), pytest.raises(SourceError, match="refused the token"):
        fetch_share(WeightSource(url, "not-the-token", retries=3), (0, 2), tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_a_source_that_is_down_fails_the_fetch_with_a_clear_error(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(SourceError, match=rf"weight source {re.escape(url)}: unreachable .*\(after 2 tries\)"):
        fetch_share(WeightSource(url, TOKEN, deadline_s=2.0, retries=1), (0, 2), tmp_path)


def test_a_source_that_never_answers_fails_the_fetch_at_its_deadline(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(SourceError, match=r"no answer within the deadline of 0.3 s"):
            fetch_share(WeightSource(url, TOKEN, deadline_s=0.3, retries=1), (0, 2), tmp_path)


def test_the_source_serves_only_its_folders_files_to_bearers_of_its_token(llama: Path, tmp_path: Path) -> None:
    folder = tmp_path / "served"
    shutil.copytree(llama, folder)
    (tmp_path / "secret.txt").write_text("outside the folder")
    (folder / ".hidden").write_text("hidden")
    (folder / "sub").mkdir()
    (folder / "sub" / "inner.txt").write_text("in a subfolder")
    with serving(folder) as (url, _app):
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)

        def status(path: str, token: str = TOKEN) -> int:
            conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
            answer = conn.getresponse()
            answer.read()
            return answer.status

        for path in (
            "/v1/files/../secret.txt",
            "/v1/files/..%2Fsecret.txt",
            "/v1/files/%2E%2E%2Fsecret.txt",
            "/v1/files/..",
            "/v1/files/.hidden",
            "/v1/files/sub%2Finner.txt",
            "/v1/files/sub",
            f"/v1/files/{tmp_path / 'secret.txt'}",
        ):
            assert status(path) == 404, path
        assert status("/v1/files/config.json") == 200
        assert status("/v1/files/config.json", "wrong") == 401 and status("/v1/manifest", "") == 401
        conn.request(
            "GET", "/v1/files/config.json", headers={"Authorization": f"Bearer {TOKEN}", "Range": "bytes=9999999-"}
        )
        answer = conn.getresponse()
        answer.read()
        assert answer.status == 416
        conn.close()


def test_a_truncated_or_corrupt_range_is_detected_and_retried(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source whose answers end early (framing cut: the connection closes short of Content-Length), or are
    shorter than the range asked for, or whose bytes do not match their Content-Digest: each try fails, and the
    fetch fails naming it; a source that fails once is retried and the share is the right one."""
    stream, span = weight_source._stream, weight_source._span

    def cut(app: Starlette, path: Path, start: int, end: int) -> Iterator[bytes]:
        yield from weight_source._chunks(path, start, max(start, end - 5))

    def short(header: str | None, size: int) -> tuple[int, int] | None:
        got = span(header, size)
        return None if got is None else (got[0], max(got[0] + 1, got[1] - 5)) if header else got

    def flipped(app: Starlette, path: Path, start: int, end: int) -> Iterator[bytes]:
        for data in stream(app, path, start, end):
            yield bytes([data[0] ^ 1]) + data[1:]

    with serving(llama) as (url, _app):
        source = WeightSource(url, TOKEN, retries=1)
        monkeypatch.setattr(weight_source, "_stream", cut)
        with pytest.raises(SourceError, match=r"request failed .*after 2 tries"):
            fetch_share(source, (2, 4), tmp_path)
        monkeypatch.setattr(weight_source, "_stream", stream)
        monkeypatch.setattr(weight_source, "_span", short)
        with pytest.raises(SourceError, match=r"bytes received, not .*after 2 tries"):
            fetch_share(source, (2, 4), tmp_path)
        monkeypatch.setattr(weight_source, "_span", span)
        monkeypatch.setattr(weight_source, "_stream", flipped)
        with pytest.raises(SourceError, match="do not match their Content-Digest"):
            fetch_share(source, (2, 4), tmp_path)
        assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # nothing half-written kept
        answers = iter([flipped])  # the first answer corrupt, the others right

        def once_flipped(app: Starlette, path: Path, start: int, end: int) -> Iterator[bytes]:
            yield from next(answers, stream)(app, path, start, end)

        monkeypatch.setattr(weight_source, "_stream", once_flipped)
        share = fetch_share(source, (2, 4), tmp_path)
    local, fetched = Stage(llama, (2, 4)), Stage(share, (2, 4))
    _same_outputs(local, fetched, StageIO(hidden=torch.linspace(-2, 2, 6 * 64).view(1, 6, 64)))


def test_a_header_longer_than_the_first_read_is_read_in_full(llama: Path) -> None:
    data = (llama / "model.safetensors").read_bytes()
    with pytest.raises(ShortHeader) as short:
        parse_index(data[:100], len(data))
    index = parse_index(data[: short.value.needed], len(data))
    with safe_open(str(llama / "model.safetensors"), framework="pt") as handle:
        assert set(index.tensors) == set(handle.keys())


def test_cli_model_serve_needs_a_token_and_serves_a_folder(llama: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEJAVU_")}
    command = [sys.executable, "-m", "dejavu_cli", "model", "serve", str(llama), "--port", str(_free_port())]
    refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "DEJAVU_MODEL__SOURCE_TOKEN" in refused.stderr
    port = _free_port()
    command[-1] = str(port)
    process = subprocess.Popen(command, env={**env, "DEJAVU_MODEL__SOURCE_TOKEN": TOKEN})
    try:
        source = WeightSource(f"http://127.0.0.1:{port}", TOKEN, deadline_s=5.0, retries=0)
        deadline = time.monotonic() + 60
        while True:
            try:
                share = fetch_share(source, (4, 6), tmp_path)
                break
            except SourceError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.2)
        _same_outputs(Stage(llama, (4, 6)), Stage(share, (4, 6)), StageIO(hidden=torch.ones(1, 6, 64)))
    finally:
        process.terminate()
        process.wait(10)
