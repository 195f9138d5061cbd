"""Hosts with network links of their own, emulated on one Linux machine.

Every host is a network namespace joined to a bridge by a veth pair. With a
rate, both ends of each pair get a token-bucket filter (tc tbf), so a host
sends at most `mbps` and receives at most `mbps`, as a pod host's NIC does:
full duplex, its own, whatever the other hosts do. Processes run on a host
through `ip netns exec` (Host.prefix); a unix socket still reaches them, the
file system being shared.

With `cpus`, every host also gets that many cores of this machine's (a cgroup
v1 CPU quota, CFS): its processes, and any thread of this one that calls
Host.enter(), share that much CPU, whatever the other hosts use, as a pod
host's processes share its own cores. Hosts times `cpus` should stay within
this machine's cores. Threads of one Python process on different hosts still
share its GIL: one throttled while it holds the GIL stops the others until its
next period, so a host's client belongs in a process of its own
(bench/fanout.py's ProcessClients; BENCHMARKS.md, "Fan-out: many workers fetch one artifact at once").
Quotas gives hosts of CPU only, on this machine's network (a process joins
its host by writing its pid to the quota's cgroup.procs).

Needs root (CAP_NET_ADMIN) and iproute2 (`ip`, `tc`); `cpus` needs the
cgroup v1 cpu controller at /sys/fs/cgroup/cpu. Everything made is named
with PREFIX and removed by close(), and any leftovers of an earlier run that
was killed are removed first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

PREFIX = "ccne"
BRIDGE = f"{PREFIX}-br"
SUBNET = "10.88"
CGROUPS = Path("/sys/fs/cgroup/cpu")
LOCK = Path("/tmp") / f"{PREFIX}.lock"  # one emulated network at a time: a second would remove it
MTU = 9000  # jumbo frames, as in the data centers pods run in: fewer packets for the kernel


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check)


def quotas_available() -> str | None:
    """None when CPU quotas can be made here, else why not."""
    if not (CGROUPS / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUPS}"
    if not os.access(CGROUPS, os.W_OK):
        return f"cannot make cgroups in {CGROUPS} (needs root)"
    return None


def available(cpus: float = 0) -> str | None:
    """None when hosts can be emulated here, else why not."""
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) is not installed"
    if cpus and (why := quotas_available()):
        return why
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
    cgroup: Path | None = None  # its CPU quota, if any

    @property
    def prefix(self) -> tuple[str, ...]:
        """Runs a command on this host: in its namespace (and CPU quota)."""
        ns = ("ip", "netns", "exec", self.ns)
        if self.cgroup is None:
            return ns
        # The quota first: `ip netns exec` mounts a sysfs of the namespace's,
        # without the cgroup file system.
        return ("sh", "-c", f'echo $$ > {self.cgroup}/cgroup.procs && exec "$@"', "sh", *ns)

    def enter(self) -> None:
        """The calling thread uses this host's CPU quota from now on (its
        network stays this machine's: a client reaches its worker over a unix
        socket)."""
        if self.cgroup is not None:
            (self.cgroup / "tasks").write_text(str(threading.get_native_id()))


def quota(name: str, cpus: float, period_ms: float = 0) -> Path:
    """A cgroup (v1 cpu controller) of `cpus` cores, PREFIX-name: what its
    processes and threads use together, whatever the rest of the machine
    does. Network.close() or Quotas.close() removes it."""
    cgroup = CGROUPS / f"{PREFIX}-{name}"
    cgroup.mkdir()
    if period_ms:
        (cgroup / "cpu.cfs_period_us").write_text(str(int(period_ms * 1000)))
    period = int((cgroup / "cpu.cfs_period_us").read_text())
    (cgroup / "cpu.cfs_quota_us").write_text(str(int(period * cpus)))
    return cgroup


class Quotas:
    """Hosts of CPU only: a quota each (see quota()), with this machine's
    network. One emulation at a time (LOCK); what an earlier run that was
    killed left is removed first."""

    def __init__(self, cpus: float = 0, cpu_period_ms: float = 0) -> None:
        self.cpus = cpus
        self.cpu_period_ms = cpu_period_ms  # CFS period of a host's quota (0: the kernel's)
        self._lock = open(LOCK, "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(f"another run is using the emulated network ({LOCK})") from None
        self._cleanup()

    def quota(self, name: str) -> Path:
        return quota(name, self.cpus, self.cpu_period_ms)

    def close(self) -> None:
        self._cleanup()
        self._lock.close()  # and with it the lock

    @staticmethod
    def _cleanup() -> None:
        ip = shutil.which("ip") is not None  # CPU quotas alone do without iproute2
        for line in _ip("netns", "list", check=False).stdout.splitlines() if ip else ():
            ns = line.split()[0] if line.strip() else ""
            if ns.startswith(f"{PREFIX}-"):
                _ip("netns", "del", ns, check=False)  # its veth ends go with it
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines() if ip else ():
            name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
            if name.startswith(PREFIX):  # the bridge, and veths a killed run left
                _ip("link", "del", name, check=False)
        for cg in CGROUPS.glob(f"{PREFIX}-*") if CGROUPS.exists() else ():
            for tid in (cg / "tasks").read_text().split():  # threads of ours still in it
                try:
                    (CGROUPS / "tasks").write_text(tid)
                except OSError:
                    pass
            try:
                os.rmdir(cg)
            except OSError:
                pass  # a process of a killed run still in it


class Network(Quotas):
    def __init__(self, mbps: float = 0, cpus: float = 0, cpu_period_ms: float = 0) -> None:
        super().__init__(cpus, cpu_period_ms)
        self.mbps = mbps
        self.hosts: list[Host] = []
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
        if self.cpus:
            h.cgroup = self.quota(str(i))
        return h

    def _limit(self, h: Host) -> None:
        # burst: a few ms at the rate, and at least 256 KiB, so that TCP's
        # segmentation offload packets (up to 64 KiB) pass whole instead of
        # being cut up by tbf (which costs the kernel more CPU than the
        # processes spend on the bytes); latency: the queue a sender may build
        # before packets are dropped (TCP then backs off).
        burst = max(256 << 10, int(self.mbps * 1e6 / 8 * 0.004))
        tbf = ("root", "tbf", "rate", f"{self.mbps}mbit", "burst", str(burst), "latency", "50ms")
        _run(["tc", "qdisc", "add", "dev", h.veth, *tbf])
        _ip("netns", "exec", h.ns, "tc", "qdisc", "add", "dev", "eth0", *tbf)

    def close(self) -> None:
        super().close()
        self.hosts.clear()
