"""A weight source (``dejavu_engine.weight_source``) served in the test process, for the tests of stage shares."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from dejavu_engine import weight_source

TOKEN = "a-test-token-of-32-characters-00"


@contextmanager
def serving(folder: Path, token: str = TOKEN) -> Iterator[tuple[str, Starlette]]:
    """The weight source of ``folder`` on a free port (uvicorn in a thread): its URL and app (``app.state.bytes_sent``
    counts the file bytes it sent); shut down on exit."""
    app = weight_source.create_app(folder, token)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the weight source did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(10)
