"""Hostile input to a running system: nothing it injects is accepted, and the system keeps serving.

- a data-plane peer with a wrong secret, or with the right secret but a stale epoch, or with the right
  secret at the current epoch in a worker's name (without that worker's key), sends tokens,
  activations and KV to every worker;
- malformed entries land on every Redis stream the services read;
- an admin command signed with a key that is not the deployment's (a worker's own verify key
  included) orders a worker to die, and a genuine command is replayed;
- an unauthenticated client streams a 64 MiB body at the API and reads /metrics without a key: the
  controller answers 401 and its peak memory does not grow by the body.
"""

from __future__ import annotations

import base64
import contextlib
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
from openai import OpenAI
from pydantic import SecretStr

from dejavu_common import keys
from dejavu_common.admin import generate_keypair, sign
from dejavu_common.messages import AdminAction, Topology, WorkerInfo
from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import ensure_default_model
from dejavulib.endpoint import Endpoint
from dejavulib.header import Channel, Header
from dejavulib.transport.ucx import UcxTransport

from .cluster import cluster_settings, logs, running
from .reference import Reference

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

API_KEY = "sk-security-test"


def _rogue_sends(settings: Settings, secret: str, epoch: int, sender: str = "rogue") -> None:
    """Connect to every worker's data plane and send garbage on every channel, as ``sender``."""
    client = redis.Redis.from_url(settings.redis.url)
    ep = Endpoint(UcxTransport(sender), secret, epoch=epoch)
    try:
        for wid in (m.decode() for m in client.smembers(keys.WORKERS)):
            info = WorkerInfo.decode(client.hget(keys.worker(wid), "info"))
            ep.connect(wid, base64.b64decode(info.data_address))
            for channel in Channel:
                payload = np.frombuffer(b"\x10\x00\x00\x00" + b"{" * 16 + b"\x00" * 64, np.uint8)
                ep.send(wid, Header(channel=channel, microbatch=0, step=1), payload).wait(5)
    finally:
        ep.close()


def _peak_rss_growth(pid: int, action) -> int:
    """Bytes by which ``pid``'s peak resident memory (VmHWM) rises above its resident memory during ``action``."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the high-water mark to the current RSS

    def field(name: str) -> int:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(name))
        return int(line.split()[1]) * 1024

    before = field("VmRSS:")
    action()
    return field("VmHWM:") - before


def _unauthenticated_big_body(api_url: str) -> None:
    def body():
        for _ in range(1024):  # 64 MiB
            yield b" " * (64 << 10)

    with httpx.Client(timeout=30) as http:
        assert http.get(api_url + "/metrics").status_code == 401
        with contextlib.suppress(httpx.TransportError):  # the server may close while we still write
            response = http.post(
                api_url + "/v1/completions", content=body(), headers={"Content-Type": "application/json"}
            )
            assert response.status_code == 401


def test_rogue_peers_malformed_streams_and_forged_admin_commands(redis_url) -> None:
    model = ensure_default_model(Settings())
    reference = Reference(model)
    settings = cluster_settings(
        redis_url,
        model,
        prompt_depth=1,
        token_depth=2,
        prompt_microbatch=2,
        token_microbatch=2,
        controller={"api_keys": [SecretStr(API_KEY)]},
    )
    with running(settings) as launcher:
        client = redis.Redis.from_url(settings.redis.url)
        epoch = Topology.decode(client.get(keys.TOPOLOGY)).epoch
        secret = settings.transport.secret.get_secret_value()
        _rogue_sends(settings, "not-the-secret", epoch)  # wrong secret
        _rogue_sends(settings, secret, epoch - 1)  # a fenced (older-epoch) sender
        _rogue_sends(settings, secret, epoch, sender="t0")  # a member speaking for t0 without t0's key
        for stream in (keys.PROMPT_QUEUE, keys.COLOCATED_QUEUE, keys.READY_QUEUE, keys.ADMIN_STREAM):
            client.xadd(stream, {"task": b"{bad", "done": b"[]", "cmd": b"{}"})
        client.xadd(keys.tokens(12345), {"step": b"nonsense"})
        instance = WorkerInfo.decode(client.hget(keys.worker("t0"), "info")).instance
        for key in (generate_keypair()[0], settings.admin.verify_key):  # a stranger's key, a worker's key
            forged = sign(key, "t0", instance, AdminAction.KILL)
            client.xadd(keys.ADMIN_STREAM, {"cmd": forged.encode()})
        # A genuine, harmless order (a pause shorter than the lease), then the same entry again.
        pause = sign(settings.admin.signing_key.get_secret_value(), "t1",
                     WorkerInfo.decode(client.hget(keys.worker("t1"), "info")).instance,
                     AdminAction.PAUSE_HEARTBEATS, seconds=0.3)  # fmt: skip
        client.xadd(keys.ADMIN_STREAM, {"cmd": pause.encode()})
        time.sleep(1.0)
        client.xadd(keys.ADMIN_STREAM, {"cmd": pause.encode()})
        controller = launcher.child("controller").proc.pid
        growth = _peak_rss_growth(controller, lambda: _unauthenticated_big_body(launcher.api_url))
        print(f"controller peak RSS growth during a 64 MiB unauthenticated body: {growth} bytes")
        assert growth < 16 << 20, f"the controller's peak memory grew by {growth} bytes"

        api = OpenAI(base_url=launcher.api_url + "/v1", api_key=API_KEY, timeout=180, max_retries=0)
        for prompt in ("The capital of France is", "def fibonacci(n):"):
            r = api.completions.create(model=settings.model.name, prompt=prompt, max_tokens=8, temperature=0)
            assert r.choices[0].text == reference.text(prompt, 8), logs(launcher)
        for child in launcher.children:
            assert child.proc.poll() is None, f"{child.name} died\n{logs(launcher)}"
        # The forged kill is read by a worker's heartbeat thread, asynchronously to the requests above.
        # Search whole logs: the line can be followed by more than a tail's worth of UCX protocol tables.
        deadline = time.monotonic() + 30
        while "bad signature" not in logs(launcher, tail=None) and time.monotonic() < deadline:
            time.sleep(0.2)
        text = logs(launcher, tail=None)
        assert text.count("bad signature") == 2, logs(launcher)  # both forged kills were refused
        assert "not its published" in text, logs(launcher)  # the messages in t0's name were refused
        assert text.count("pause-heartbeats 0.3") == 1 and "replayed" in text, logs(launcher)
