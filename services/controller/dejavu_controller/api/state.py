"""What a running gateway holds: built once by the lifespan, reached by routes through dependencies."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from dejavu_common.settings import Settings
from dejavu_common.tokenizer import Tokenizer
from dejavu_controller.backend import Backend, GenerationRequest
from dejavu_controller.model_info import context_limit

from .generation import Generation
from .metrics import GatewayMetrics, RuntimeMetrics

# Builds the serving runtime for the app's lifetime: entered at startup, exited at shutdown. It gets
# the settings and the metrics it may feed; it must not block the event loop while entering.
BackendFactory = Callable[[Settings, RuntimeMetrics], AbstractAsyncContextManager[Backend]]


@dataclass(frozen=True)
class Gateway:
    """The live parts of one app; immutable once the lifespan has started."""

    settings: Settings
    backend: Backend
    tokenizer: Tokenizer
    metrics: GatewayMetrics
    started_at: int  # unix seconds; the model card's ``created``

    @property
    def model_name(self) -> str:
        return self.settings.model.name

    @property
    def max_context(self) -> int:
        """Positions a request may span: the configured bound, capped at the model's own limit."""
        return context_limit(self.settings.model.folder, self.settings.engine.max_context)

    def generation(self, request: GenerationRequest) -> Generation:
        """A :class:`Generation` of ``request`` on this gateway's backend, tokenizer and metrics."""
        return Generation(
            self.backend, self.tokenizer, self.metrics, request, self.settings.controller.request_timeout_s
        )
