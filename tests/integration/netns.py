"""Hosts made of Linux network namespaces, for tests that need more than one machine.

One ``Network`` is a hub namespace and N host namespaces, each host joined to the hub by its
own veth pair and its own /24 from 198.18.0.0/15 (the benchmarking range: never routed on the
internet, unlikely to be in use here):

    host i                                   hub
    198.18.i.2/24 on <tok>h<i>  ── veth ──   198.18.i.1/24 on <tok>g<i>
    default route via 198.18.i.1             ip_forward=1 (this namespace only)

The hub is the router between hosts, and the rendezvous server runs there. A host reaches the
server's address on another subnet through its default route, so every agent can use the same
``--rdzv-endpoint``, and host-to-host traffic (TCPStore, gloo) crosses the hub as it would cross
a switch. Nothing is added to the root namespace: no address, route or sysctl, so the machine's
own network is untouched; the veth pairs only pass through it between ``ip link add`` and
``ip link set … netns``.

Names carry this process's pid and a random token, so parallel or leftover runs never clash.
``close()`` (and the context manager) undoes everything, whatever state setup reached: it kills
the processes it started, then every process still inside one of its namespaces (found with
``ip netns pids``, killed through a pidfd, so a reused pid is never hit), deletes the
namespaces (which deletes their veths) and any veth still left in the root namespace.
"""

from __future__ import annotations

import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .procs import ROOT, Proc

IP_TIMEOUT = 10.0  # one `ip` command
KILL_TIMEOUT = 10.0  # for everything left in one namespace to die after SIGKILL
NETNS_DIR = Path("/run/netns")
_ENABLE_FORWARDING = "open('/proc/sys/net/ipv4/ip_forward', 'w').write('1')"


class NetnsSetupError(RuntimeError):
    """An `ip` command failed while the test network was being built or taken down."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise NetnsSetupError(f"ip {' '.join(args)} did not finish within {IP_TIMEOUT:g} s") from None
    if check and res.returncode != 0:
        raise NetnsSetupError(f"ip {' '.join(args)} exited with {res.returncode}: {res.stderr.strip()}")
    return res


def skip_unless_netns_possible() -> None:
    """Skip the test, saying why, where namespaces cannot be made (not root, no iproute2)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (`ip netns add` needs CAP_SYS_ADMIN)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")


def _ns_inode(name: str) -> int:
    return os.stat(NETNS_DIR / name).st_ino


class NsProc(Proc):
    """A :class:`Proc` whose waits can ignore the lines it printed before a mark.

    An elastic job prints the same line in several rounds ("world size 1" before a node joins
    and again after it is lost); ``wait_for_line(..., after=proc.mark())`` waits for a new one.
    """

    def mark(self, stream: str = "err") -> int:
        with self._cond:
            return len(self.err if stream == "err" else self.out)

    def wait_for_line(
        self, pattern: str, *, stream: str = "err", timeout: float = 30.0, after: int = 0
    ) -> re.Match[str]:
        rx = re.compile(pattern)
        sink = self.err if stream == "err" else self.out
        deadline = time.monotonic() + timeout
        seen = after
        with self._cond:
            while True:
                for line in sink[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = max(seen, len(sink))
                left = deadline - time.monotonic()
                ended = self.p.poll() is not None and not any(t.is_alive() for t in self._threads)
                if left <= 0 or ended:
                    why = "the process ended" if ended else f"{timeout:g} s passed"
                    raise AssertionError(
                        f"no line matching {pattern!r} after line {after} of std{stream} "
                        f"({why}) from {self.argv}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"
                    )
                self._cond.wait(timeout=min(left, 0.5))

    def lines(self, stream: str = "err", after: int = 0) -> list[str]:
        with self._cond:
            return list((self.err if stream == "err" else self.out)[after:])


@dataclass(frozen=True)
class Host:
    """One simulated machine: a namespace with one veth to the hub."""

    ns: str
    ifname: str  # the veth inside this namespace (what GLOO_SOCKET_IFNAME names)
    addr: str
    hub_ifname: str  # its peer, inside the hub namespace
    gateway: str  # the hub's address on this link

    @property
    def netns_inode(self) -> int:
        """The inode of the namespace: what /proc/self/ns/net of a process inside it stats to."""
        return _ns_inode(self.ns)


@dataclass
class Network:
    hub: str
    hosts: list[Host] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)
    _links: list[str] = field(default_factory=list)  # created in the root namespace
    _procs: list[NsProc] = field(default_factory=list)

    @classmethod
    def create(cls, n_hosts: int) -> Network:
        """Build the hub and ``n_hosts`` hosts; skips the test if namespaces cannot be made."""
        skip_unless_netns_possible()
        if not 1 <= n_hosts <= 254:
            raise ValueError(f"n_hosts {n_hosts} not in 1..254")
        tok = secrets.token_hex(3)
        base = f"elastic-mh-{os.getpid()}-{tok}"
        net = cls(hub=f"{base}-hub")
        try:
            res = ip("netns", "add", net.hub, check=False)
            if res.returncode != 0:
                pytest.skip(f"`ip netns add` failed here: {res.stderr.strip() or res.returncode}")
            net._namespaces.append(net.hub)
            ip("-n", net.hub, "link", "set", "lo", "up")
            # A new namespace starts with forwarding off; the hub routes between the hosts' subnets.
            # /proc/sys/net is the opener's namespace's, so this changes the hub's setting only.
            ip("netns", "exec", net.hub, sys.executable, "-c", _ENABLE_FORWARDING)
            for i in range(n_hosts):
                net._add_host(base, tok, i)
        except BaseException:
            net.close()
            raise
        return net

    def _add_host(self, base: str, tok: str, i: int) -> None:
        # Interface names are at most 15 bytes: "mh" + 6 hex + "h"/"g" + up to 3 digits.
        host = Host(
            ns=f"{base}-host{i}",
            ifname=f"mh{tok}h{i}",
            addr=f"198.18.{i}.2",
            hub_ifname=f"mh{tok}g{i}",
            gateway=f"198.18.{i}.1",
        )
        ip("netns", "add", host.ns)
        self._namespaces.append(host.ns)
        ip("link", "add", host.ifname, "type", "veth", "peer", "name", host.hub_ifname)
        self._links.append(host.ifname)
        ip("link", "set", host.ifname, "netns", host.ns)
        ip("link", "set", host.hub_ifname, "netns", self.hub)
        ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
        ip("-n", self.hub, "addr", "add", f"{host.gateway}/24", "dev", host.hub_ifname)
        for ns, dev in ((host.ns, "lo"), (host.ns, host.ifname), (self.hub, host.hub_ifname)):
            ip("-n", ns, "link", "set", dev, "up")
        ip("-n", host.ns, "route", "add", "default", "via", host.gateway)
        self.hosts.append(host)

    # -- processes -------------------------------------------------------------------------

    def spawn(self, ns: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> NsProc:
        """Start ``argv`` inside namespace ``ns`` (its own session, output collected)."""
        if ns not in self._namespaces:
            raise ValueError(f"{ns} is not a namespace of this network")
        proc = NsProc(["ip", "netns", "exec", ns, *argv], env=dict(env or {}), cwd=ROOT)
        self._procs.append(proc)
        return proc

    def cut(self, host: Host) -> None:
        """Pull the host's cable at the hub: its link goes down, nothing (no FIN, no RST) is sent."""
        ip("-n", self.hub, "link", "set", host.hub_ifname, "down")

    # -- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Undo everything; safe to call at any point of setup, and more than once."""
        errors: list[str] = []
        for proc in self._procs:
            proc.kill()  # the process group ip netns exec became; workers die with their agent
        self._procs.clear()
        for ns in reversed(self._namespaces):
            try:
                left = kill_everything_in(ns)
                if left:
                    errors.append(f"{ns}: pids {left} still alive {KILL_TIMEOUT:g} s after SIGKILL")
            except (OSError, NetnsSetupError) as exc:
                errors.append(f"{ns}: {exc}")
            res = ip("netns", "del", ns, check=False)
            if res.returncode != 0 and (NETNS_DIR / ns).exists():
                errors.append(f"ip netns del {ns}: {res.stderr.strip()}")
        self._namespaces.clear()
        for link in self._links:
            # Only a link that never got moved is still here; deleting one end deletes its peer.
            if ip("link", "show", link, check=False).returncode == 0:
                ip("link", "del", link, check=False)
        self._links.clear()
        if errors:
            raise NetnsSetupError("teardown left things behind: " + "; ".join(errors))

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def kill_everything_in(ns: str) -> list[int]:
    """SIGKILL every process in namespace ``ns`` until none is left; return any survivors.

    Passes repeat because a process may fork between ``ip netns pids`` and its kill; a few are
    plenty, since what we start here (agents, their watchdogs) is dead after the first.
    """
    left: list[int] = []
    for _ in range(5):
        pids = [int(x) for x in ip("netns", "pids", ns).stdout.split()]
        if not pids:
            return []
        left = _kill_and_wait(ns, pids)
        if left:
            return left
    return [int(x) for x in ip("netns", "pids", ns).stdout.split()]


def _kill_and_wait(ns: str, pids: list[int]) -> list[int]:
    """SIGKILL ``pids`` (those still in ``ns``) and wait for each to exit; return the survivors."""
    inode = _ns_inode(ns)
    fds: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            # Opened first, checked second: if the pid was reused, the check fails or the pidfd
            # names a process that has exited (and a signal to it goes nowhere).
            if _netns_of(pid) != inode:
                os.close(fd)
                continue
            fds[pid] = fd
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        poller = select.poll()
        for fd in fds.values():
            poller.register(fd, select.POLLIN)
        pending = set(fds.values())
        deadline = time.monotonic() + KILL_TIMEOUT
        while pending:
            left = deadline - time.monotonic()
            # A pidfd polls readable once its process has exited.
            ready = poller.poll(max(0, int(left * 1000))) if left > 0 else []
            if not ready:
                break
            for fd, _ in ready:
                poller.unregister(fd)
                pending.discard(fd)
        return [pid for pid, fd in fds.items() if fd in pending]
    finally:
        for fd in fds.values():
            os.close(fd)


def _netns_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def listening_port(server: NsProc, addr: str, *, timeout: float = 20.0) -> int:
    """The port an ``rdzv-server --port 0`` reports once it listens on ``addr``."""
    m = server.wait_for_line(rf"listening on {re.escape(addr)}:(\d+)", timeout=timeout)
    return int(m.group(1))
