"""What each API key may use of the gateway: token buckets for requests and tokens, and a cap on
requests in flight (``controller.key_limits``, per key ``controller.key_limits_by_id``).

Every key has (each limit can be off):

- a request bucket per second and one per minute: an admitted request takes one from each;
- a token bucket per minute: a generation takes its prompt plus its budget (``max_tokens``, or what the
  context leaves) when it is admitted, and gets back, when its request ends, what it did not generate
  (reconciled: the key pays for the tokens it used, but must hold the budget while it runs);
- a count of requests in flight, capped.

Without API keys, the API listens on loopback only and every client is a local process, so all
requests share one quota, under the key id ``anonymous``: limits per client address would tell
nothing apart (every client is 127.0.0.1) and would grow a label per address.

A request over a limit is answered 429 in OpenAI's shape with ``Retry-After``: whole seconds until
the bucket holds enough again (1 for the concurrency cap: a slot frees when a request ends). A
generation needing more tokens than the whole bucket holds is refused without ``Retry-After`` and
with ``x-should-retry: false`` (the openai client then does not retry): waiting cannot help.

:class:`QuotaGate` admits each ``/v1`` request before the app reads its body, holds its concurrency
slot until the app has sent the whole response (a stream included) or the client has gone, and hands
the request its :class:`Lease` (``request.state.lease``), to which :func:`~.dispatch.start` charges
each generation's tokens. Everything runs on the event loop's thread: there are no locks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

from dejavu_common.settings import ControllerSettings, KeyLimits

from .auth import ApiKeyVerifier
from .errors import ApiError, RateLimitError, error_body
from .guard import bearer_token
from .metrics import GatewayMetrics, KeyMetrics

if TYPE_CHECKING:
    from .generation import Generation

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Clock = Callable[[], float]

REQUESTS = "requests"  # the ``type`` of a 429 for a request-rate or concurrency limit (OpenAI's)
TOKENS = "tokens"  # the ``type`` of a 429 for the token budget


@dataclass
class TokenBucket:
    """Holds up to ``capacity``, refilled at ``rate_per_s``; starts full. ``now`` is the caller's clock."""

    capacity: float
    rate_per_s: float
    level: float = -1.0  # < 0: full, not yet used
    updated: float = 0.0

    @classmethod
    def per(cls, amount: float, period_s: float) -> TokenBucket:
        """``amount`` per ``period_s``, sustained, and bursts of ``amount`` at once (at least 1)."""
        return cls(capacity=max(amount, 1.0), rate_per_s=amount / period_s)

    def wait_s(self, amount: float, now: float) -> float | None:
        """Seconds until ``amount`` can be taken (0: now); None if it never can (more than the capacity)."""
        if amount > self.capacity:
            return None
        self._refill(now)
        return max(0.0, (amount - self.level) / self.rate_per_s)

    def take(self, amount: float, now: float) -> None:
        """Take ``amount`` (the caller checked :meth:`wait_s` is 0)."""
        self._refill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        """Give back ``amount`` taken earlier and not used (never above the capacity)."""
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def _refill(self, now: float) -> None:
        if self.level < 0:
            self.level = self.capacity
        else:
            self.level = min(self.capacity, self.level + max(0.0, now - self.updated) * self.rate_per_s)
        self.updated = now


class KeyQuota:
    """The buckets and the in-flight count of one key."""

    def __init__(self, key: str, limits: KeyLimits, metrics: KeyMetrics, clock: Clock) -> None:
        self.key = key
        self.limits = limits
        self.clock = clock
        self._metrics = metrics
        self._request_buckets: list[tuple[str, TokenBucket]] = []
        if limits.requests_per_second is not None:
            self._request_buckets.append(("requests_per_second", TokenBucket.per(limits.requests_per_second, 1.0)))
        if limits.requests_per_minute is not None:
            self._request_buckets.append(("requests_per_minute", TokenBucket.per(limits.requests_per_minute, 60.0)))
        tpm = limits.tokens_per_minute
        self._tokens = TokenBucket.per(tpm, 60.0) if tpm is not None else None
        self.in_flight = 0
        metrics.in_flight.labels(key=key).set(0)

    def admit(self) -> Lease:
        """A lease for one more request, or :class:`RateLimitError` (the request buckets are only taken
        from when every limit admits it)."""
        cap = self.limits.max_concurrent
        if cap is not None and self.in_flight >= cap:
            raise self._refused("max_concurrent", REQUESTS, 1.0, f"this API key has {cap} requests in flight already")
        now = self.clock()
        for name, bucket in self._request_buckets:
            wait = bucket.wait_s(1, now)
            if wait:  # never None: a request bucket holds at least one
                raise self._refused(name, REQUESTS, wait, f"this API key used up its {name.replace('_', ' ')}")
        for _, bucket in self._request_buckets:
            bucket.take(1, now)
        self.in_flight += 1
        self._metrics.admitted.labels(key=self.key).inc()
        self._metrics.in_flight.labels(key=self.key).set(self.in_flight)
        return Lease(self)

    def take_tokens(self, amount: int) -> None:
        """Charge ``amount`` tokens, or raise :class:`RateLimitError` (nothing charged)."""
        if self._tokens is None:
            return
        now = self.clock()
        wait = self._tokens.wait_s(amount, now)
        if wait is None:
            self._metrics.limited.labels(key=self.key, limit="tokens_per_minute").inc()
            error = RateLimitError(
                f"this request needs {amount} tokens (prompt + max_tokens), more than this API key's limit of "
                f"{self.limits.tokens_per_minute} tokens per minute: lower max_tokens or shorten the prompt",
                kind=TOKENS,
                retry_after_s=None,
            )
            error.headers["x-should-retry"] = "false"
            raise error
        if wait:
            why = f"this API key used up its tokens per minute ({amount} needed)"
            raise self._refused("tokens_per_minute", TOKENS, wait, why)
        self._tokens.take(amount, now)

    def give_tokens(self, amount: int) -> None:
        if self._tokens is not None and amount > 0:
            self._tokens.give(amount, self.clock())

    def release(self, used_tokens: int) -> None:
        """One request ended having used ``used_tokens`` (prompt + generated)."""
        self.in_flight -= 1
        self._metrics.in_flight.labels(key=self.key).set(self.in_flight)
        if used_tokens:
            self._metrics.tokens.labels(key=self.key).inc(used_tokens)

    def _refused(self, limit: str, kind: str, retry_after_s: float, why: str) -> RateLimitError:
        self._metrics.limited.labels(key=self.key, limit=limit).inc()
        return RateLimitError(f"rate limit reached: {why}", kind=kind, retry_after_s=retry_after_s)


class Lease:
    """One admitted request's hold on its key's quota: its concurrency slot and the tokens charged to it.
    :meth:`release` (once, when the response is over) frees the slot and gives back unused tokens."""

    def __init__(self, quota: KeyQuota) -> None:
        self._quota = quota
        self._charges: list[tuple[int, Generation]] = []
        self._released = False

    @property
    def key(self) -> str:
        return self._quota.key

    def charge(self, generation: Generation) -> None:
        """Charge ``generation``'s prompt and budget to the key's tokens, or raise :class:`RateLimitError`."""
        cost = generation.prompt_tokens + generation.request.sampling.max_tokens
        self._quota.take_tokens(cost)
        self._charges.append((cost, generation))

    def release(self) -> None:
        """Free the slot; give back each generation's unused budget (all of it if it never started)."""
        if self._released:
            return
        self._released = True
        used_total = 0
        for cost, generation in self._charges:
            used = generation.prompt_tokens + generation.completion_tokens if generation.started else 0
            self._quota.give_tokens(cost - min(used, cost))
            used_total += used
        self._quota.release(used_total)


class Quotas:
    """The quota of every key a request may carry: the configured keys' ids, or ``anonymous`` alone."""

    def __init__(
        self, settings: ControllerSettings, key_ids: Sequence[str], metrics: KeyMetrics, clock: Clock = time.monotonic
    ) -> None:
        unknown = sorted(set(settings.key_limits_by_id) - set(key_ids))
        if unknown:
            raise ValueError(
                f"controller.key_limits_by_id names {unknown}, the id of no configured API key "
                f"(the configured keys' ids: {sorted(key_ids)})"
            )
        self._clock = clock
        self._quotas = {key: KeyQuota(key, limits_of(settings, key), metrics, self._now) for key in key_ids}

    def _now(self) -> float:
        return self._clock()

    def set_clock(self, clock: Clock) -> None:
        """Read time from ``clock`` from now on (tests; before the first request)."""
        self._clock = clock

    def admit(self, key: str) -> Lease:
        return self._quotas[key].admit()

    def in_flight(self, key: str) -> int:
        return self._quotas[key].in_flight


def limits_of(settings: ControllerSettings, key: str) -> KeyLimits:
    """``key``'s limits: its entry in ``key_limits_by_id`` over ``key_limits``, field by field."""
    override = settings.key_limits_by_id.get(key)
    if override is None:
        return settings.key_limits
    return settings.key_limits.model_copy(update=override.model_dump(exclude_unset=True))


class QuotaGate:
    """See the module docstring. Sits inside :class:`~.guard.RequestGuard`: the key is verified by then."""

    def __init__(self, app: ASGIApp, verifier: ApiKeyVerifier, quotas: Quotas, metrics: GatewayMetrics) -> None:
        self.app = app
        self.verifier = verifier
        self.quotas = quotas
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), None)
        try:
            key = self.verifier.identify(bearer_token(authorization.decode("latin-1") if authorization else None))
            lease = self.quotas.admit(key)
        except ApiError as error:
            self.metrics.count_rejection(error.status)
            body = error_body(error.message, error.type, error.param, error.code)
            await JSONResponse(body, status_code=error.status, headers=error.headers)(scope, receive, send)
            return

        async def send_then_release(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                lease.release()  # before the client can see the end: its next request finds the slot free
            await send(message)

        scope.setdefault("state", {})["lease"] = lease
        try:
            await self.app(scope, receive, send_then_release)
        finally:  # the response is over: sent, failed, or its client gone (the app is cancelled then)
            lease.release()
