"""The controller's REST gateway: an OpenAI-compatible FastAPI app over the :class:`~dejavu_controller.backend.Backend`.

Public API: :func:`create_app`, :func:`run_api`, :data:`BackendFactory`, :class:`RuntimeMetrics`
(what the backend may feed) and :class:`KVStream`.
"""

from .app import create_app
from .auth import InsecureExposureError
from .metrics import KVStream, RuntimeMetrics
from .server import run_api, uvicorn_config
from .state import BackendFactory

__all__ = [
    "BackendFactory",
    "InsecureExposureError",
    "KVStream",
    "RuntimeMetrics",
    "create_app",
    "run_api",
    "uvicorn_config",
]
