"""Log lines of the services (dejavu_common.logs): text or JSON, naming the service, the worker and the request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dejavu_common.settings import Settings

_SCRIPT = r"""
import asyncio, logging, sys
from dejavu_common import logs

logs.configure("INFO", "token-worker", "t0", sys.argv[1])
log = logging.getLogger("dejavu.test")

async def serve(request_id):
    logs.bind_request(request_id)
    log.info("serving %s", "it")
    await asyncio.sleep(0)
    logging.getLogger("httpx").info("a library's line")

async def main():
    await asyncio.gather(serve("cmpl-1"), serve("cmpl-2"))
    log.info("no request here")
    log.warning("about a microbatch", extra={"mb_id": 7})
    try:
        1 / 0
    except ZeroDivisionError:
        log.exception("failed")

asyncio.run(main())
"""


def _lines(fmt: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, fmt], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


def test_json_lines_name_the_service_the_worker_and_each_tasks_request() -> None:
    lines = [json.loads(line) for line in _lines("json")]
    assert all(line["service"] == "token-worker" and line["worker_id"] == "t0" for line in lines)
    serving = [line for line in lines if line["message"] == "serving it"]
    assert sorted(line["request_id"] for line in serving) == ["cmpl-1", "cmpl-2"]
    library = [line for line in lines if line["logger"] == "httpx"]
    assert sorted(line["request_id"] for line in library) == ["cmpl-1", "cmpl-2"]
    (plain,) = [line for line in lines if line["message"] == "no request here"]
    assert "request_id" not in plain and plain["level"] == "INFO" and plain["time"].endswith("Z")
    (mb,) = [line for line in lines if line["message"] == "about a microbatch"]
    assert mb["mb_id"] == 7 and mb["level"] == "WARNING"
    (failed,) = [line for line in lines if line["message"] == "failed"]
    assert "ZeroDivisionError" in failed["exception"]


def test_text_lines_carry_the_same_facts() -> None:
    lines = _lines("text")
    assert any("token-worker t0 dejavu.test INFO serving it [request=cmpl-1]" in line for line in lines)
    assert any("about a microbatch [mb=7]" in line for line in lines)
    assert any(line.startswith("Traceback") for line in lines)


def test_the_format_is_a_setting_with_two_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJAVU_LOG_FORMAT", "json")
    assert Settings().log_format == "json"
    monkeypatch.setenv("DEJAVU_LOG_FORMAT", "yaml")
    with pytest.raises(ValueError, match="log_format"):
        Settings()
