"""The gateway's connections under a real uvicorn server: stalled clients (slowloris) neither starve it nor
stay open, and the probes stay answerable (the API port's /health, and the probe listener).

Raw sockets play the stalling clients; httpx and http.client the honest ones. Waits are bounded polls:
a connection is awaited to close, never timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from dejavu_common.settings import Settings
from dejavu_controller.api.auth import ApiKeyVerifier
from dejavu_controller.api.guard import RequestGuard
from dejavu_controller.api.metrics import GatewayMetrics

from .conftest import API_KEY, MODEL, REPLY, LiveServer, ScriptedBackend, free_port, sse_payloads

AUTH = {"Authorization": f"Bearer {API_KEY}"}
COMPLETION = {"model": MODEL, "prompt": "Tell me", "max_tokens": 100}
HALF_HEADER = b"GET /health HTTP/1.1\r\nHost: gateway\r\nX-Slow: "
WAIT_S = 30.0  # bound of every poll: far longer than any deadline set here


def _settings(settings: Settings, **controller: Any) -> Settings:
    return settings.model_copy(update={"controller": settings.controller.model_copy(update=controller)})


@contextmanager
def _served(settings: Settings, backend: ScriptedBackend, **controller: Any) -> Iterator[LiveServer]:
    server = LiveServer(_settings(settings, **controller), backend)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _stall(port: int, count: int, payload: bytes = HALF_HEADER) -> list[socket.socket]:
    """``count`` connections that each send ``payload`` and then nothing."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        with contextlib.suppress(OSError):  # already closed (evicted): still a connection the server handled
            sock.sendall(payload)
        sockets.append(sock)
    return sockets


def _is_closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset); False while it is open and silent."""
    sock.settimeout(0.01)
    try:
        data = sock.recv(4096)
    except TimeoutError:
        return False
    except OSError:
        return True
    assert data == b"", f"the server answered a stalled connection: {data[:80]!r}"
    return True


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.05)


def _wait_closed(sockets: list[socket.socket]) -> None:
    pending = list(sockets)

    def all_closed() -> bool:
        pending[:] = [sock for sock in pending if not _is_closed(sock)]
        return not pending

    try:
        _wait_until(all_closed, f"the server closed every stalled connection ({len(pending)} still open)")
    finally:
        for sock in sockets:
            sock.close()


def _closed_count(client: httpx.Client, reason: str) -> float:
    metrics = client.get("/metrics", headers=AUTH).text
    for line in metrics.splitlines():
        if line.startswith(f'dejavu_connections_closed_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_stalled_headers_neither_starve_the_gateway_nor_stay_open(settings: Settings, backend: ScriptedBackend):
    """Three times more half-sent headers than the connection caps: the probes and a real request are still
    answered, and every stalled connection is closed (evicted for newer ones, or at the header deadline)."""
    limits = {"max_connections": 100, "max_idle_connections": 50, "header_timeout_s": 3.0}
    with _served(settings, backend, **limits) as server:
        stalled = _stall(server.port, 300)
        try:
            with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
                assert client.get("/health").status_code == 200
                assert client.get("/ready").status_code == 200
                answer = client.post("/v1/completions", json=COMPLETION, headers=AUTH)
                assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == REPLY
        finally:
            _wait_closed(stalled)
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            assert _closed_count(client, "evicted") >= 250  # all but the last max_idle_connections
            assert _closed_count(client, "evicted") + _closed_count(client, "header_timeout") >= 300


def test_a_stalled_header_is_closed_at_the_deadline(settings: Settings, backend: ScriptedBackend):
    """Under the idle cap, only the header deadline closes them: silent new connections, half-sent headers,
    and a kept-alive connection that sent the start of its next request; a kept-alive connection that
    sends nothing is kept for ``keep_alive_s``, past the header deadline, and serves its next request."""
    with _served(settings, backend, header_timeout_s=0.5, keep_alive_s=60.0) as server:
        kept = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
        kept.request("GET", "/health")
        assert kept.getresponse().read() == b'{"status":"ok"}'
        restarted = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
        restarted.request("GET", "/health")
        restarted.getresponse().read()
        assert restarted.sock is not None
        restarted.sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        stalled = [*_stall(server.port, 5, b""), *_stall(server.port, 15), restarted.sock]
        _wait_closed(stalled)
        kept.request("GET", "/health")  # idle for longer than the header deadline: not closed
        assert kept.getresponse().status == 200
        kept.close()
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            assert _closed_count(client, "header_timeout") >= 21


def test_a_stalled_body_is_dropped_and_its_connection_closed(settings: Settings, backend: ScriptedBackend):
    """A body stalled halfway, and a body trickled a byte at a time (progress, yet not done by the deadline),
    are closed at the body deadline; neither request reaches the backend, and the next request is served."""
    with _served(settings, backend, body_timeout_s=0.5) as server:
        header = (
            f"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 500\r\n\r\n"
        ).encode()
        (stalled,) = _stall(server.port, 1, header + b'{"model": "')
        (trickled,) = _stall(server.port, 1, header)

        def trickled_closed() -> bool:
            try:
                trickled.sendall(b" ")
            except OSError:
                return True
            return _is_closed(trickled)

        _wait_until(trickled_closed, "the server closed the trickled body's connection")
        trickled.close()
        _wait_closed([stalled])
        assert backend.requests == []
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            answer = client.post("/v1/completions", json=COMPLETION, headers=AUTH)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == REPLY
            assert _closed_count(client, "body_timeout") == 2


def test_a_body_cut_short_never_reaches_the_app():
    """The guard hands the app whole bodies only: a connection that ends mid-body (the client left, or the
    body deadline closed it) ends the request there, unanswered, instead of passing the part as a whole."""
    reached: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(await receive())

    async def send(message: Any) -> None:
        raise AssertionError(f"answered a request whose client is gone: {message}")

    messages = iter([{"type": "http.request", "body": b'{"model": "', "more_body": True}, {"type": "http.disconnect"}])

    async def receive() -> Any:
        return next(messages)

    guard = RequestGuard(app, ApiKeyVerifier([]), GatewayMetrics(), max_body_bytes=1 << 20)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"500")]
    asyncio.run(guard({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive, send))
    assert reached == []


def test_a_request_in_progress_outlives_the_receive_deadlines(settings: Settings, backend: ScriptedBackend):
    """The deadlines bound what the client sends, not the answer: a stream longer than both is delivered whole."""
    backend.token_delay_s = 0.05  # the reply's ~20 tokens take ~1 s, twice the deadlines
    with (
        _served(settings, backend, header_timeout_s=0.5, body_timeout_s=0.5) as server,
        httpx.Client(base_url=server.url, timeout=WAIT_S, headers=AUTH) as client,
    ):
        body = client.post("/v1/completions", json={**COMPLETION, "stream": True}).text
        assert "".join(p["choices"][0]["text"] for p in sse_payloads(body) if p != "[DONE]") == REPLY


def test_probes_are_answered_on_their_own_listener_under_pressure(settings: Settings, backend: ScriptedBackend):
    """With the API port's only request slot taken by a stream and its idle slots flooded by stalled headers,
    the probe listener answers /health and /ready (and only those), and so does the API port's /health,
    which is never refused; another API request is answered 503."""
    backend.token_delay_s = 0.2
    probe_port = free_port()
    limits = {"max_connections": 1, "max_idle_connections": 20, "header_timeout_s": 5.0, "probe_port": probe_port}
    with (
        _served(settings, backend, **limits) as server,
        httpx.Client(base_url=server.url, timeout=WAIT_S, headers=AUTH) as api,
        httpx.Client(base_url=f"http://127.0.0.1:{probe_port}", timeout=WAIT_S) as probe,
    ):
        assert server.server.probe_port == probe_port
        with api.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as stream:
            assert stream.status_code == 200 and backend.started_event.wait(WAIT_S)
            stalled = _stall(server.port, 200)
            try:
                assert probe.get("/health").json() == {"status": "ok"}
                assert probe.get("/ready").json() == {"status": "ready"}
                refused = probe.get("/v1/models", headers=AUTH)
                assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found"
                with httpx.Client(base_url=server.url, timeout=WAIT_S, headers=AUTH) as second:
                    assert second.get("/health").status_code == 200
                    assert second.get("/v1/models").status_code == 503  # the stream holds the one slot
            finally:
                _wait_closed(stalled)
            stream.read()
        assert api.get("/v1/models").status_code == 200  # the slot is free again


def test_a_taken_probe_port_fails_the_start(settings: Settings, backend: ScriptedBackend):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = LiveServer(_settings(settings, probe_port=taken.getsockname()[1]), backend)
        with pytest.raises(RuntimeError, match="did not start"):
            server.start()
        with pytest.raises(OSError):  # the API listener was closed again
            socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S).close()
