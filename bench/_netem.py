"""Hosts with network links of their own, emulated on one Linux machine.

Every host is a network namespace joined to a bridge by a veth pair. With a
rate, both ends of each pair get a token-bucket filter (tc tbf), so a host
sends at most `mbps` and receives at most `mbps`, as a pod host's NIC does:
full duplex, its own, whatever the other hosts do. Processes run on a host
through `ip netns exec` (Host.prefix); a unix socket still reaches them, the
file system being shared.

Needs root (CAP_NET_ADMIN) and iproute2 (`ip`, `tc`). Everything made is
named with PREFIX and removed by close(), and any leftovers of an earlier
run that was killed are removed first.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

PREFIX = "ccne"
BRIDGE = f"{PREFIX}-br"
SUBNET = "10.88"
MTU = 9000  # jumbo frames, as in the data centers pods run in: fewer packets for the kernel


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when hosts can be emulated here, else why not."""
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) is not installed"
    probe = f"{PREFIX}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode:
        return f"cannot make a network namespace: {r.stderr.strip()} (needs root)"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    ip: str
    ns: str
    veth: str  # the bridge's end; the host's end is `eth0` inside `ns`

    @property
    def prefix(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns)


class Network:
    def __init__(self, mbps: float) -> None:
        self.mbps = mbps
        self.hosts: list[Host] = []
        self._cleanup()
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("link", "set", BRIDGE, "mtu", str(MTU))
        _ip("addr", "add", f"{SUBNET}.0.1/16", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")

    def host(self, name: str) -> Host:
        i = len(self.hosts)
        h = Host(name, f"{SUBNET}.{1 + i // 200}.{10 + i % 200}", f"{PREFIX}-{i}", f"{PREFIX}{i}")
        _ip("netns", "add", h.ns)
        _ip("link", "add", h.veth, "mtu", str(MTU), "type", "veth", "peer", "name", f"{h.veth}x",
            "mtu", str(MTU))
        _ip("link", "set", f"{h.veth}x", "netns", h.ns)
        _ip("link", "set", h.veth, "master", BRIDGE)
        _ip("link", "set", h.veth, "up")
        inside = ("netns", "exec", h.ns, "ip")
        _ip(*inside, "link", "set", f"{h.veth}x", "name", "eth0")
        _ip(*inside, "addr", "add", f"{h.ip}/16", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "link", "set", "lo", "up")
        self.hosts.append(h)
        if self.mbps:
            self._limit(h)
        return h

    def _limit(self, h: Host) -> None:
        # burst: a few ms at the rate, and at least 256 KiB, so that TCP's
        # segmentation offload packets (up to 64 KiB) pass whole instead of
        # being cut up by tbf (which costs the kernel more CPU than the
        # processes spend on the bytes); latency: the queue a sender may build
        # before packets are dropped (TCP then backs off).
        burst = max(256 << 10, int(self.mbps * 1e6 / 8 * 0.004))
        tbf = ("root", "tbf", "rate", f"{self.mbps}mbit", "burst", str(burst), "latency", "50ms")
        subprocess.run(["tc", "qdisc", "add", "dev", h.veth, *tbf], check=True)
        subprocess.run(["ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", "eth0", *tbf],
                       check=True)

    def close(self) -> None:
        self._cleanup()
        self.hosts.clear()

    @staticmethod
    def _cleanup() -> None:
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            ns = line.split()[0] if line.strip() else ""
            if ns.startswith(f"{PREFIX}-"):
                _ip("netns", "del", ns, check=False)  # its veth ends go with it
        _ip("link", "del", BRIDGE, check=False)
