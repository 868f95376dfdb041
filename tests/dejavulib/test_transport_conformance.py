"""One conformance test for every transport: byte-exact flush/fetch round trips, single chunks and the
many keyed chunks of a region (the per-chunk and buffered scatter/gather of ``benchmarks/per_chunk.py``).

Each case sends data to a peer that echoes every chunk back under the same key, then checks the echo
is byte-identical. The UCX peer is a real process; the other transports (disk, and the tests' fake)
echo from a thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.per_chunk import contiguous_runs, gather, scatter
from dejavulib.errors import TransferTimeout
from dejavulib.kvcache import KVCache, StagingBuffer
from dejavulib.layout import KVLayout, Region, Which
from dejavulib.transport.base import Transport
from dejavulib.transport.disk import DiskTransport

from .fake_transport import FakeTransport

DEADLINE = 10.0


class ThreadEcho:
    """An in-process peer echoing chunks from a thread."""

    def __init__(self, mine: Transport, theirs: Transport) -> None:
        self.transport, self.peer, self._threads = mine, theirs, []

    def start_echo(self, specs: list[tuple[int, int]]) -> None:
        def run() -> None:  # all in, then all out: the sender may block until its last chunk is taken
            bufs = [(key, np.empty(nbytes, np.uint8)) for key, nbytes in specs]
            for key, buf in bufs:
                self.peer.fetch(self.transport.self_id, key, buf, DEADLINE)
            for key, buf in bufs:
                self.peer.flush(self.transport.self_id, key, buf, DEADLINE)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        for t in self._threads:
            t.join(DEADLINE)


class ProcessEcho:
    """The UCX peer process echoing chunks."""

    def __init__(self, ucx_peer) -> None:
        self.transport, self._peer = ucx_peer.transport, ucx_peer

    def start_echo(self, specs: list[tuple[int, int]]) -> None:
        self._peer.command(op="echo_chunks", specs=[list(s) for s in specs])

    def close(self) -> None:
        pass


def _pair(kind: str, tmp_path: Path) -> tuple[Transport, Transport]:
    if kind == "fake":
        return FakeTransport("driver"), FakeTransport("peer")
    return DiskTransport("driver", tmp_path), DiskTransport("peer", tmp_path)


@pytest.fixture(params=["fake", "disk", pytest.param("ucx", marks=pytest.mark.ucx)])
def echo(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ThreadEcho | ProcessEcho]:
    if request.param == "ucx":
        yield ProcessEcho(request.getfixturevalue("ucx_peer"))
        return
    mine, theirs = _pair(request.param, tmp_path)
    mine.connect("peer", theirs.address)
    theirs.connect("driver", mine.address)
    peer = ThreadEcho(mine, theirs)
    try:
        yield peer
    finally:
        peer.close()
        mine.close()
        theirs.close()


def _random_cache(layout: KVLayout, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache.allocate(layout)
    cache.k.copy_(torch.randn(layout.shape, generator=g).to(cache.k.dtype))
    cache.v.copy_(torch.randn(layout.shape, generator=g).to(cache.v.dtype))
    return cache


@pytest.mark.parametrize("nbytes", [1, 100, 8192, 3 << 20])
def test_flush_fetch_round_trip(echo, nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    echo.start_echo([(11, nbytes)])
    echo.transport.flush("peer", 11, data, DEADLINE)
    back = np.zeros_like(data)
    echo.transport.fetch("peer", 11, back, DEADLINE)
    assert back.tobytes() == data.tobytes()


def test_flush_fetch_torch_dtypes(echo) -> None:
    tensors = [torch.arange(1000, dtype=torch.int64), torch.randn(33, 7).to(torch.bfloat16), torch.randn(5, 64)]
    echo.start_echo([(20 + i, t.numel() * t.element_size()) for i, t in enumerate(tensors)])
    for i, t in enumerate(tensors):
        echo.transport.flush("peer", 20 + i, t, DEADLINE)
    for i, t in enumerate(tensors):
        back = torch.empty_like(t)
        echo.transport.fetch("peer", 20 + i, back, DEADLINE)
        assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("kind", ["fake", "disk"])
def test_a_discarded_slot_is_gone_and_the_others_stay(kind: str, tmp_path: Path) -> None:
    """Slot transports keep every chunk until it is discarded (what a replica store frees with its
    microbatch); fetching a discarded chunk waits as for one never sent."""
    mine, theirs = _pair(kind, tmp_path)
    mine.connect("peer", theirs.address)
    a, b = np.full(64, 1, np.uint8), np.full(64, 2, np.uint8)
    mine.flush("peer", 1, a, DEADLINE)
    mine.flush("peer", 2, b, DEADLINE)
    theirs.discard("driver", 1)
    theirs.discard("driver", 1)  # twice: nothing left to forget
    back = np.zeros(64, np.uint8)
    with pytest.raises(TransferTimeout):
        theirs.fetch("driver", 1, back, 0.05)
    theirs.fetch("driver", 2, back, DEADLINE)
    assert back.tobytes() == b.tobytes()
    if kind == "disk":
        assert [p.name for p in theirs.root.iterdir()] == ["driver.2.kv"]
    mine.close()
    theirs.close()


GEOMETRIES = [
    KVLayout(layers=3, batch=4, kv_heads=3, max_len=16, head_dim=8, first_layer=5),  # GQA-like, odd heads
    KVLayout(layers=2, batch=2, kv_heads=8, max_len=12, head_dim=4, dtype="bfloat16"),
    KVLayout(layers=4, batch=3, kv_heads=1, max_len=8, head_dim=16, dtype="float16"),
]


def _regions(layout: KVLayout) -> list[Region]:
    a, b = layout.layer_range
    return [
        layout.region(positions=(7, 8)),  # one decode step's update: many small chunks
        layout.region(layers=(a + 1, b), rows=(1, 2), positions=(2, 6), which=Which.K),
        layout.region(rows=(0, 1)),  # whole positions of some rows: one run per layer
        layout.region(),  # everything: one run per tensor
    ]


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("layout", GEOMETRIES, ids=lambda lay: f"{lay.dtype}-h{lay.kv_heads}")
def test_scatter_gather_round_trip(echo, layout: KVLayout, buffered: bool) -> None:
    source = _random_cache(layout, seed=layout.kv_heads)
    key = 1000
    for region in _regions(layout):
        if buffered:
            specs = [(key, region.nbytes(layout))]
        else:
            runs = list(contiguous_runs(layout, region))
            specs = [(key + i, r.count * layout.itemsize) for i, r in enumerate(runs)]
        echo.start_echo(specs)
        staging = StagingBuffer() if buffered else None
        sent = scatter(echo.transport, "peer", key, source, region, DEADLINE, staging)
        received = KVCache.allocate(layout)
        got = gather(echo.transport, "peer", key, received, region, DEADLINE, StagingBuffer() if buffered else None)
        assert sent == got == len(specs)
        for which in region.tensors:
            assert torch.equal(received.view(region, which), source.view(region, which))
        rest = KVCache(layout, received.k.clone(), received.v.clone())
        for which in region.tensors:
            rest.view(region, which).zero_()
        assert not rest.k.any() and not rest.v.any(), "bytes outside the region were written"
        key += len(specs)


def test_unbuffered_chunk_count_matches_layout() -> None:
    layout = KVLayout(layers=30, batch=8, kv_heads=3, max_len=1024, head_dim=64)
    assert len(list(contiguous_runs(layout, layout.region(positions=(1000, 1001))))) == 2 * 30 * 8 * 3
    assert len(list(contiguous_runs(layout, layout.region(rows=(2, 5), which=Which.K)))) == 30  # one per layer
    assert len(list(contiguous_runs(layout, layout.region(layers=(4, 9))))) == 2  # whole layers: one per tensor
