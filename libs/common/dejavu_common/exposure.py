"""Whether a deployment is reachable beyond this host, and the refusal to expose a default secret.

The settings carry development defaults (``transport.secret`` is ``dejavu-dev-secret``) so that a
single-host run needs no set-up. Those values are public, so a process whose data plane listens on
anything but loopback refuses to start with one; ``infra/secrets/generate.sh`` writes real ones.
"""

from __future__ import annotations

import ipaddress

from dejavu_common.settings import DEV_DATA_PLANE_SECRET, TransportSettings


class InsecureDefaultError(ValueError):
    """A public development secret on a deployment reachable from other hosts."""


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1; False for anything else (``0.0.0.0`` included)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_data_plane(transport: TransportSettings) -> None:
    """Raise :class:`InsecureDefaultError` if the data plane would serve beyond loopback with the
    development secret (anyone could then authenticate messages to it)."""
    if transport.secret.get_secret_value() == DEV_DATA_PLANE_SECRET and not is_loopback(transport.host):
        raise InsecureDefaultError(
            f"refusing to serve the data plane on {transport.host!r} with the public development secret: set "
            "DEJAVU_TRANSPORT__SECRET (infra/secrets/generate.sh writes one) or bind to 127.0.0.1"
        )
