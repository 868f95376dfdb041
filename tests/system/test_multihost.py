"""Redis, the controller and every worker on its own host (network namespace, own address), so every
hop — Redis, UCX (TCP), HTTP — crosses a real network interface. Then one token worker's link is cut:
it is detected and recovered like a crash."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import ensure_default_model

from . import netns
from .cluster import cluster_settings
from .reference import Reference

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

API_KEY = "multihost-test-key"
LONG = 96  # tokens per request while t1's link is cut
PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]


def _wait_http(url: str, timeout_s: float, procs: list[subprocess.Popen], logs: Path) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for p in procs:
            assert p.poll() is None, f"a process exited early; logs in {logs}:\n" + _logs(logs)
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"{url} not ready after {timeout_s} s\n" + _logs(logs))


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(folder.glob("*.log")))


def test_every_hop_crosses_a_network_interface_and_a_cut_link_is_recovered() -> None:
    reason = netns.available()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    model = ensure_default_model(Settings())
    reference = Reference(model)
    logs = Path(tempfile.mkdtemp(prefix="dejavu-multihost-"))
    net = netns.Network()
    procs: list[subprocess.Popen] = []
    try:
        hosts = {name: net.add(name) for name in ("redis", "ctl", "p0", "t0", "t1", "spare0")}
        redis_url = f"redis://{hosts['redis']}:6379/0"
        procs.append(
            net.popen(
                "redis",
                [
                    shutil.which("redis-server"),
                    "--bind",
                    hosts["redis"],
                    "--port",
                    "6379",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--protected-mode",
                    "no",
                ],
                dict(os.environ),
                logs / "redis.log",
            )
        )
        settings = cluster_settings(
            redis_url,
            model,
            prompt_depth=1,
            token_depth=2,
            prompt_microbatch=2,
            token_microbatch=2,
            controller={"host": hosts["ctl"], "port": 8000, "api_keys": [API_KEY]},
        )

        def env(host: str) -> dict[str, str]:
            e = {k: v for k, v in os.environ.items() if not k.startswith("DEJAVU_")}
            e.update(settings.to_env())
            e.pop("DEJAVU_ADMIN__SIGNING_KEY", None)  # no process but the admin tool signs commands
            e["DEJAVU_TRANSPORT__HOST"] = hosts[host]
            e["UCX_TLS"] = "tcp"  # no shared memory between "hosts"
            e["UCX_NET_DEVICES"] = net.interface(host)
            e["PYTHONUNBUFFERED"] = "1"
            return e

        time.sleep(0.3)
        procs.append(net.popen("ctl", [sys.executable, "-m", "dejavu_controller"], env("ctl"), logs / "ctl.log"))
        workers = {
            "p0": ("dejavu_prompt_worker", []),
            "t0": ("dejavu_token_worker", []),
            "t1": ("dejavu_token_worker", []),
            "spare0": ("dejavu_token_worker", ["--spare"]),
        }
        for name, (module, extra) in workers.items():
            argv = [sys.executable, "-m", module, "--worker-id", name, *extra]
            procs.append(net.popen(name, argv, env(name), logs / f"{name}.log"))
        api = f"http://{hosts['ctl']}:8000"
        _wait_http(api + "/ready", 180, procs, logs)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        assert httpx.post(api + "/v1/completions", json={"model": "x", "prompt": "x"}, timeout=10).status_code == 401

        def complete(prompt: str, out: dict, tokens: int = 16) -> None:
            body = {"model": settings.model.name, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
            r = httpx.post(api + "/v1/completions", json=body, headers=headers, timeout=240)
            out[prompt] = (r.status_code, r.json())

        results: dict = {}
        for p in PROMPTS:
            complete(p, results)
        for p in PROMPTS:
            status, body = results[p]
            assert status == 200 and body["choices"][0]["text"] == reference.text(p, 16), _logs(logs)

        # Cut t1's link while requests are in flight: its lease expires, the spare takes its stage.
        # Longer answers keep the requests in flight well past the cut.
        results.clear()
        threads = [threading.Thread(target=complete, args=(p, results, LONG)) for p in PROMPTS]
        for t in threads:
            t.start()
        time.sleep(2.0)
        net.cut("t1")
        for t in threads:
            t.join(260)
            assert not t.is_alive(), "a request hung"
        for p in PROMPTS:
            status, body = results[p]
            assert status == 200 and body["choices"][0]["text"] == reference.text(p, LONG), _logs(logs)
        assert "lost ['t1']" in (logs / "ctl.log").read_text(), _logs(logs)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        net.close()
        shutil.rmtree(logs, ignore_errors=True)
