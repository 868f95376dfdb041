"""The controller's REST gateway: an OpenAI-compatible FastAPI app over the :class:`~dejavu_controller.backend.Backend`.

Public API: :func:`create_app`, :func:`run_api` (or :func:`gateway_server` to drive the server
yourself), :data:`BackendFactory`, :class:`RuntimeMetrics`
(what the backend may feed) and :class:`KVStream`.
"""

from .app import create_app
from .auth import InsecureExposureError
from .metrics import KVStream, RuntimeMetrics
from .server import GatewayServer, gateway_server, run_api, uvicorn_config
from .state import BackendFactory

__all__ = [
    "BackendFactory",
    "GatewayServer",
    "InsecureExposureError",
    "KVStream",
    "RuntimeMetrics",
    "create_app",
    "gateway_server",
    "run_api",
    "uvicorn_config",
]
