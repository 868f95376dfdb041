"""Binding the UCX data plane to ``transport.host``: the interface lookup, and what a bound worker advertises."""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from dejavulib.endpoint import Endpoint
from dejavulib.errors import TransportUnavailable
from dejavulib.header import Channel, Header
from dejavulib.transport.interfaces import interface_of, local_addresses


def test_interface_of_known_addresses() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("localhost") == "lo"
    assert interface_of("::1") == "lo"
    for wildcard in ("0.0.0.0", "::", ""):
        assert interface_of(wildcard) is None
    for name, addresses in local_addresses().items():
        for address in addresses:
            if not address.is_link_local:
                assert interface_of(str(address)) == name


@pytest.mark.parametrize("host", ["192.0.2.254", "203.0.113.9", "no-such-host.invalid"])
def test_an_address_this_machine_does_not_have_is_refused(host: str) -> None:
    if any(ipaddress.ip_address(host) in a for a in local_addresses().values() if host[0].isdigit()):
        pytest.skip("this machine has that address")
    with pytest.raises(TransportUnavailable):
        interface_of(host)


@pytest.mark.ucx
def test_a_loopback_bound_data_plane_advertises_no_other_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from dejavulib.transport.ucx import UcxTransport

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    others = [
        a.packed for addresses in local_addresses().values() for a in addresses if a.version == 4 and not a.is_loopback
    ]
    if not others:
        pytest.skip("no non-loopback IPv4 address here")
    unbound = UcxTransport("unbound")
    bound, peer = UcxTransport("bound", host="127.0.0.1"), UcxTransport("peer", host="127.0.0.1")
    try:
        assert any(packed in unbound.address for packed in others)  # by default every interface is advertised
        assert not any(packed in bound.address for packed in others)
        a, b = Endpoint(bound, "s"), Endpoint(peer, "s")
        a.connect("peer", peer.address)  # and two bound peers on one host still talk
        a.send("peer", Header(Channel.TOKENS), np.arange(4, dtype=np.uint8)).wait(10)
        assert b.recv(Channel.TOKENS, 10).payload.tolist() == [0, 1, 2, 3]
    finally:
        for transport in (unbound, bound, peer):
            transport.close()
