"""Redis clients built from :class:`RedisSettings`, with deadlines and redis-py retry objects."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from dejavu_common.settings import RedisSettings

_RETRY_ON = (RedisConnectionError, RedisTimeoutError)


def text(value: bytes | str) -> str:
    """A Redis reply as text: the clients here return bytes (no ``decode_responses``); redis-py types replies
    as bytes or str."""
    return value.decode() if isinstance(value, bytes) else value


def data(value: bytes | str) -> bytes:
    """A Redis reply as bytes (see :func:`text`)."""
    return value if isinstance(value, bytes) else value.encode()


def _kwargs(settings: RedisSettings) -> dict:
    kw: dict = {
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": settings.connect_timeout_s,
        "health_check_interval": 10,
    }
    if settings.username is not None:
        kw["username"] = settings.username
    if settings.password_file is not None:  # e.g. written for this pod alone by its init container
        kw["password"] = settings.password_file.read_text().strip()
    elif settings.password is not None:
        kw["password"] = settings.password.get_secret_value()
    return kw


def sync_client(settings: RedisSettings) -> redis.Redis:
    """A thread-safe (pooled) synchronous client; every command has ``socket_timeout_s``."""
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), settings.retries, supported_errors=_RETRY_ON)
    return redis.Redis.from_url(settings.url, retry=retry, **_kwargs(settings))


def async_client(settings: RedisSettings) -> aioredis.Redis:
    """An asyncio client for the controller."""
    from redis.asyncio.retry import Retry as AsyncRetry

    retry = AsyncRetry(ExponentialBackoff(cap=1.0, base=0.05), settings.retries, supported_errors=_RETRY_ON)
    return aioredis.Redis.from_url(settings.url, retry=retry, **_kwargs(settings))
