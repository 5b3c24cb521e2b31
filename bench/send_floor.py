"""The kernel's floor under a broadcast: plain ``socket.send`` to M loopback sockets.

A re-rendezvous of M agents costs the server two rounds of M sends (Restart, then the
Assignments) and M reads (the Joins in between). On loopback every send also does the
receiving side's TCP work and wakes the receiving process, so a send costs the sender some
15 µs however little Python is around it. This measures that floor with no protocol, no event
loop and no validation: one process sends one small frame to each of M sockets whose other
ends are held, and read, by a few receiver processes, as the simulated agents are.

Run as a module, it is one receiver: ``python -m bench.send_floor --port P --count K``.
"""

from __future__ import annotations

import argparse
import selectors
import socket
import sys
import time

from protocol import Restart, encode

from .procs import Trial, raise_nofile_limit, shares

FRAME = encode(Restart(round=1, reason="node sim-000099 (127.0.0.1) connection closed", restart_count=0))


def measure(trial: Trial, m: int, procs: int, timeout: float = 60.0) -> float:
    """Seconds for one process to send FRAME once to each of m connected loopback sockets.

    The receivers are the trial's processes (tagged, logged, and cleaned up with it)."""
    raise_nofile_limit()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(min(m, 4096))
    listener.settimeout(timeout)
    port = listener.getsockname()[1]
    counts = shares(m, procs)
    receivers = [
        trial.launch(
            f"floor{i}",
            [sys.executable, "-m", "bench.send_floor", "--port", str(port), "--count", str(k)],
            pipes=True,
        ).popen
        for i, k in enumerate(counts)
    ]
    conns: list[socket.socket] = []
    try:
        while len(conns) < m:
            c, _ = listener.accept()
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio's transports
            conns.append(c)
        for r in receivers:
            assert r.stdout is not None
            if r.stdout.readline().strip() != b"ready":
                raise RuntimeError("a send-floor receiver did not get ready")
        t0 = time.perf_counter()
        for c in conns:
            c.send(FRAME)
        elapsed = time.perf_counter() - t0
        for r in receivers:
            r.wait(timeout)
        return elapsed
    finally:
        for r in receivers:
            if r.poll() is None:
                r.kill()
                r.wait()
        for c in conns:
            c.close()
        listener.close()


def receive(port: int, count: int, timeout: float = 60.0) -> int:
    raise_nofile_limit()
    socks = [socket.create_connection(("127.0.0.1", port), timeout=timeout) for _ in range(count)]
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    got, deadline = 0, time.monotonic() + timeout
    while got < count and time.monotonic() < deadline:
        for key, _ in sel.select(1.0):
            if key.fileobj.recv(65536):  # type: ignore[union-attr]
                got += 1
            sel.unregister(key.fileobj)
    for s in socks:
        s.close()
    return 0 if got == count else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.send_floor")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    args = p.parse_args(argv)
    return receive(args.port, args.count)


if __name__ == "__main__":
    sys.exit(main())
