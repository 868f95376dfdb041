"""Test hosts as Linux network namespaces on one bridge, each with its own address (needs root + iproute2).

Every host gets a veth pair: one end in the namespace (``10.213.0.N/24``), the other on the bridge in
the root namespace (which holds ``10.213.0.1``, so the test itself can reach every host). Everything
is created by :meth:`Network.add` and removed by :meth:`Network.close`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

SUBNET = "10.213.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> str | None:
    """None if namespaces can be made here, else the reason they cannot."""
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"dvprobe{uuid.uuid4().hex[:6]}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Network:
    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:4]
        self.bridge = f"dvbr{self.tag}"
        self.hosts: dict[str, tuple[str, str]] = {}  # name -> (namespace, address)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        # Bridged frames pass iptables' FORWARD chain when br_netfilter is loaded, and a Docker daemon
        # (the Compose test starts one) sets that chain's policy to DROP: let this bridge's own traffic by.
        self._forward = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        self._iptables = shutil.which("iptables")
        if self._iptables is not None:
            subprocess.run([self._iptables, "-I", *self._forward], capture_output=True, check=False)

    def add(self, name: str) -> str:
        """A new host called ``name``; returns its address."""
        n = len(self.hosts) + 10
        ns, outer, inner = f"dv{self.tag}{name}", f"dv{self.tag}{n}a", f"dv{self.tag}{n}b"
        address = f"{SUBNET}.{n}"
        _ip("netns", "add", ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", inner)
        _ip("netns", "exec", ns, "ip", "link", "set", inner, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        self.hosts[name] = (ns, address)
        return address

    def interface(self, name: str) -> str:
        """The host's interface inside its namespace."""
        _ns, address = self.hosts[name]
        return f"dv{self.tag}{address.rsplit('.', 1)[1]}b"

    def cut(self, name: str) -> None:
        """Take the host's link down: it stays alive but can reach nobody."""
        ns, _ = self.hosts[name]
        _ip("netns", "exec", ns, "ip", "link", "set", self.interface(name), "down")

    def popen(self, name: str, argv: list[str], env: dict[str, str], log_path) -> subprocess.Popen:
        ns, _ = self.hosts[name]
        with open(log_path, "ab") as out:
            return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, stdout=out, stderr=subprocess.STDOUT)

    def close(self) -> None:
        for ns, address in self.hosts.values():
            _ip("link", "del", f"dv{self.tag}{address.rsplit('.', 1)[1]}a", check=False)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        if self._iptables is not None:
            subprocess.run([self._iptables, "-D", *self._forward], capture_output=True, check=False)
