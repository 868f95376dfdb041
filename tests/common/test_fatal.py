"""Background loops: survivable errors restart them, anything else ends the process visibly."""

from __future__ import annotations

import threading

import pytest
import redis

from dejavu_common import fatal


@pytest.fixture
def exits(monkeypatch) -> list[int]:
    codes: list[int] = []
    monkeypatch.setattr(fatal, "_exit", codes.append)
    return codes


def test_a_guarded_thread_that_raises_ends_the_process_after_logging(exits, caplog) -> None:
    def body() -> None:
        raise KeyError("a bug")

    t = threading.Thread(target=fatal.guarded("test loop", body))
    t.start()
    t.join(5)
    assert exits == [fatal.EXIT_LOOP_DIED]
    assert "test loop died" in caplog.text and "KeyError" in caplog.text


def test_a_guarded_loop_is_started_again_after_an_error_it_outlives(exits) -> None:
    runs: list[int] = []

    def body(stop: threading.Event) -> None:
        runs.append(1)
        if len(runs) < 3:
            raise redis.ConnectionError("Redis restarting")
        stop.set()

    stop = threading.Event()
    fatal.guarded("receiver", body, retry_on=(redis.RedisError,), pause_s=0.01)(stop)
    assert len(runs) == 3 and stop.is_set() and not exits
