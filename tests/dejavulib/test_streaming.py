"""stream_out/stream_in between mismatched prompt and token pipelines, compared region by region."""

from __future__ import annotations

import threading

import pytest
import torch

from dejavulib.endpoint import Endpoint
from dejavulib.header import Channel
from dejavulib.kvcache import KVCache
from dejavulib.layout import KVLayout, Region, Which
from dejavulib.streamer import Streamer
from dejavulib.streaming import LayerStreamer, stream_in, stream_out
from dejavulib.topology import Topology, plan_transfers, token_padded_lengths
from dejavulib.transport.fake import FakeTransport

N_LAYERS, HEADS, HEAD_DIM, MAX_LEN, SECRET = 6, 3, 4, 16, "s"


def _reference(request: int, layer: int, position: int, which: Which) -> float:
    """A value unique to each cell, so any misplaced byte shows."""
    return float(request * 10_000 + layer * 100 + position) + (0.5 if which == Which.V else 0.0)


def _prompt_cache(src: Topology, stage: int, mb: int, length: int) -> KVCache:
    lo, hi = src.stage_layer_ranges[stage]
    cache = KVCache.allocate(KVLayout(hi - lo, src.microbatch_size, HEADS, MAX_LEN, HEAD_DIM, first_layer=lo))
    for which in (Which.K, Which.V):
        t = cache.tensor(which)
        for layer, row, pos in (
            (a, r, p) for a in range(lo, hi) for r in range(src.microbatch_size) for p in range(length)
        ):
            t[layer - lo, row, :, pos, :] = _reference(mb * src.microbatch_size + row, layer, pos, which)
    return cache


@pytest.mark.parametrize(
    ("dp", "mp", "dt", "mt", "lengths"),
    [(1, 4, 2, 4, [9]), (2, 4, 3, 8, [5, 9]), (2, 8, 3, 4, [7]), (2, 4, 2, 8, [12, 3])],
    ids=["1to2-stages", "2to3-mb4to8", "2to3-mb8to4", "mb4to8-lengths"],
)
def test_prompt_to_token_pipeline(dp: int, mp: int, dt: int, mt: int, lengths: list[int]) -> None:
    src, dst = Topology.even(N_LAYERS, dp, mp), Topology.even(N_LAYERS, dt, mt)
    transfers = plan_transfers(src, dst, lengths)
    dst_lengths = token_padded_lengths(src, dst, lengths)
    senders = [Endpoint(FakeTransport(f"p{s}"), SECRET) for s in range(dp)]
    receivers = [Endpoint(FakeTransport(f"t{d}"), SECRET) for d in range(dt)]
    for s in senders:
        for d, r in enumerate(receivers):
            s.connect(f"t{d}", r.address)
    token_caches = []
    for lo, hi in dst.stage_layer_ranges:
        layout = KVLayout(hi - lo, mt, HEADS, MAX_LEN, HEAD_DIM, first_layer=lo)
        token_caches.append({j: KVCache.allocate(layout) for j in range(len(dst_lengths))})
    peers = {d: f"t{d}" for d in range(dt)}

    for s, endpoint in enumerate(senders):
        streamer = Streamer(endpoint, max_inflight_bytes=1 << 20)
        for i, length in enumerate(lengths):
            cache = _prompt_cache(src, s, i, length)
            handles = stream_out(streamer, cache, transfers, s, i, peers, deadline_s=5)
            for h in handles:
                h.wait()
        streamer.close()
    for d, endpoint in enumerate(receivers):
        stream_in(endpoint, token_caches[d], transfers, d, deadline_s=5)
        assert endpoint.pending(Channel.KV_PROMPT) == 0

    for d, (lo, hi) in enumerate(dst.stage_layer_ranges):
        for j, cache in token_caches[d].items():
            for which, layer, row in ((w, a, r) for w in (Which.K, Which.V) for a in range(lo, hi) for r in range(mt)):
                request = j * mt + row
                if request >= len(lengths) * mp:
                    assert not cache.tensor(which)[layer - lo, row].any()
                    continue
                length = lengths[request // mp]
                pad = dst_lengths[j] - length
                got = cache.tensor(which)[layer - lo, row, 0, :, 0]
                want = torch.zeros(MAX_LEN)
                want[pad : pad + length] = torch.tensor([_reference(request, layer, p, which) for p in range(length)])
                assert torch.equal(got, want), f"stage {d} mb {j} {which.name} layer {layer} row {row}"


def test_layer_by_layer_streaming_overlaps_compute() -> None:
    """Each layer's KV reaches the receiver, in layer order, while later layers are still computing."""
    layout = KVLayout(layers=8, batch=2, kv_heads=HEADS, max_len=MAX_LEN, head_dim=HEAD_DIM)
    topo = Topology.even(8, 1, 2)
    transfers = plan_transfers(topo, topo, [MAX_LEN])
    sender, receiver = Endpoint(FakeTransport("p0"), SECRET), Endpoint(FakeTransport("t0"), SECRET)
    sender.connect("t0", receiver.address)
    cache, received = KVCache.allocate(layout), KVCache.allocate(layout)
    first_layer_arrived = threading.Event()
    arrivals: list[tuple[int, int]] = []  # (layer, layers computed by the sender when it arrived)
    computed = [0]

    def receive() -> None:
        for _ in range(layout.layers):
            m = receiver.recv(Channel.KV_PROMPT, 10)
            arrivals.append((m.header.layers[0], computed[0]))
            first_layer_arrived.set()
            h = m.header
            received.unpack(Region(h.microbatch, h.layers, h.rows, h.positions, Which(h.which)), m.tensor())

    thread = threading.Thread(target=receive)
    thread.start()
    streamer = Streamer(sender, max_inflight_bytes=1 << 20)
    hook = LayerStreamer(streamer, cache, transfers, 0, 0, {0: "t0"}, deadline_s=5)
    x = torch.randn(64, 64)
    for layer in range(layout.layers):
        if layer == layout.layers - 1:  # the last layer computes only once the first one has been delivered
            assert first_layer_arrived.wait(10)
        for _ in range(20):  # simulated compute: a real matmul workload writing this layer's K and V
            x = torch.tanh(x @ x) * 0.5
        cache.k[layer].copy_(x.reshape(-1)[: cache.k[layer].numel()].view_as(cache.k[layer]))
        cache.v[layer].copy_(-cache.k[layer])
        computed[0] = layer + 1
        hook.on_layer_done(layer)
    hook.wait(10)
    thread.join(10)
    streamer.close()
    assert [layer for layer, _ in arrivals] == list(range(layout.layers))
    assert arrivals[0][1] < layout.layers, "layer 0 must arrive before the last layer is computed"
    assert torch.equal(received.k, cache.k) and torch.equal(received.v, cache.v)
