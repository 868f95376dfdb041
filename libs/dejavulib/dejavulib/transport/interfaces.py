"""Which local network interface holds an address: how the UCX data plane is bound to ``transport.host``.

UCX does not listen on an address; it advertises and listens on network *devices* (``UCX_NET_DEVICES``).
Binding the data plane to the configured host therefore means: find the interface that carries the
host's address and restrict UCX's network devices to it. Shared-memory transports between processes of
one host are not network devices and are unaffected.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

from dejavulib.errors import TransportUnavailable

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})


def local_addresses() -> dict[str, set[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """Every up interface's IPv4 and IPv6 addresses, by interface name (Linux)."""
    found: dict[str, set[ipaddress.IPv4Address | ipaddress.IPv6Address]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address, or down
                continue
            found.setdefault(name, set()).add(ipaddress.IPv4Address(raw[20:24]))
    inet6 = Path("/proc/net/if_inet6")
    if inet6.exists():
        for line in inet6.read_text().splitlines():
            fields = line.split()
            if len(fields) == 6:
                found.setdefault(fields[5], set()).add(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    return found


def interface_of(host: str) -> str | None:
    """The interface carrying ``host`` (an address or a name resolved here); None for a wildcard host.

    Raises :class:`TransportUnavailable` if ``host`` does not resolve, or to no local interface: a
    data plane configured for an address this machine does not have is a configuration error.
    """
    if host.strip().strip("[]") in _WILDCARDS:
        return None
    try:
        infos = socket.getaddrinfo(host.strip().strip("[]"), None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise TransportUnavailable(f"transport.host {host!r} does not resolve: {exc}") from exc
    wanted = {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}
    for name, addresses in sorted(local_addresses().items()):
        if wanted & addresses:
            return name
    raise TransportUnavailable(f"transport.host {host!r} ({', '.join(map(str, wanted))}) is on no local interface")
