"""Schemathesis fuzzes the live gateway from its own OpenAPI schema: no input may cause a server error.

The gateway runs under a real uvicorn server with the scripted backend and API keys; Schemathesis
(its CLI, as a child process stopped by PID on timeout) reads ``/openapi.json`` with the key and sends
schema examples, boundary ("coverage") cases and random valid and invalid bodies to every operation,
bounded in examples per operation and in time. The run's figures (operations, cases, failures) are
printed; ``pytest -s`` shows them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dejavu_common.settings import KeyLimits, Settings
from dejavu_controller.api.schemas.common import MAX_CHOICES

from .conftest import API_KEY, LiveServer, ScriptedBackend, make_settings

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 40  # per operation and phase
MAX_TIME_S = 45  # the whole run; fuzzing repeats until it is spent


@pytest.fixture
def settings(tokenizer_dir: Path) -> Settings:
    """The API keys of the other tests, with the limits per key off: every generated request reaches the
    operation it targets instead of a 429."""
    base = make_settings(tokenizer_dir)
    off = KeyLimits(requests_per_second=None, requests_per_minute=None, tokens_per_minute=None, max_concurrent=None)
    return base.model_copy(update={"controller": base.controller.model_copy(update={"key_limits": off})})


def _schemathesis() -> str:
    exe = shutil.which("st", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("schemathesis is not installed (requirements/dev.txt)")
    return exe


def test_schemathesis_finds_no_server_error(live_server: LiveServer, backend: ScriptedBackend, tmp_path: Path):
    exe = _schemathesis()
    # One request of n choices takes n places: a bound below n would answer the generated n's 503 (queue full).
    backend.queue_bound = MAX_CHOICES
    report = tmp_path / "report.json"
    argv = [
        exe, "run", f"{live_server.url}/openapi.json",
        "--header", f"Authorization: Bearer {API_KEY}",
        "--checks", "not_a_server_error",
        "--phases", "examples,coverage,fuzzing",
        "--max-examples", str(MAX_EXAMPLES),
        "--max-time", str(MAX_TIME_S),
        "--seed", "20241",
        "--workers", "1",
        "--request-timeout", "20",
        "--generation-database", "none",
        "--suppress-health-check", "all",
        "--no-color",
        "--report", "json", "--report-json-path", str(report),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        output, _ = proc.communicate(timeout=MAX_TIME_S + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    print(output)
    assert report.exists(), output
    run = json.loads(report.read_text())
    rates = run["valid_rates"]
    accepted = {op: sum(phase["accepted"] for phase in by_phase.values()) for op, by_phase in rates.items()}
    figures = {
        "operations": len(rates),
        "cases": run["test_cases"]["generated"],
        "failures": len(run["failures"]),
        "errors": len(run["errors"]),
        "requests_that_reached_the_backend": len(backend.requests),
        "accepted_by_operation": accepted,
    }
    print("schemathesis figures:", json.dumps(figures))
    assert run["failures"] == [] and run["errors"] == [] and proc.returncode == 0, output
    # Not vacuous: every operation was exercised, and valid generated requests reached the backend.
    assert figures["operations"] == 9 and figures["cases"] >= 100
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= set(accepted)
    assert backend.requests  # generated requests got past validation into generation
