"""Fixtures of the request-scheduled stage tests: the default model's folder, a text's token ids, a Redis client
with the colocated stream's consumer group."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from dejavu_common import keys
from dejavu_common.settings import Settings
from dejavu_common.tokenizer import Tokenizer
from dejavu_engine.checkpoint import ensure_default_model
from dejavu_token_worker.driver import ensure_group

TEXT = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk, carrying a can of oil and a rag. "
    "From the lamp room he could see the whole bay: the fishing boats coming home, the gulls circling the "
    "harbour wall, and the long grey line of the cliffs to the north. His grandfather had kept the same light "
    "for forty years, and had written down the weather every single day in a leather notebook that still sat "
    "on the shelf by the window. Storms were recorded in red ink, calm days in black, and fog in a careful "
    "pencil that had faded to almost nothing. When the new electric lamp was installed, the engineers told "
    "him that nobody would need to climb the stairs any more, that the light would switch itself on and off "
    "with a clock. He thanked them politely, and kept climbing anyway, because the bay looked different from "
    "up there, and because somebody ought to write down the weather. In the spring a young woman from the "
    "university came to study the notebooks. She wanted to know whether the winters had grown milder, whether "
    "the storms came earlier in the year, and whether the fog was thicker than it used to be. Together they "
    "spent many afternoons turning the brittle pages and copying numbers into her computer."
)


@pytest.fixture(scope="module")
def folder() -> Path:
    """The default model's prepared folder (converted once, never downloaded)."""
    return ensure_default_model(Settings())


@pytest.fixture(scope="module")
def text_ids(folder: Path) -> list[int]:
    ids = Tokenizer.from_pretrained(folder).encode(TEXT)
    assert len(ids) >= 220
    return ids


@pytest.fixture
def client(redis_url: str):
    client = redis.Redis.from_url(redis_url)
    ensure_group(client, keys.COLOCATED_QUEUE, keys.COLOCATED_GROUP)
    yield client
    client.close()
