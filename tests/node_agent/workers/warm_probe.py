"""What a worker sees of its own start, for the cold/warm parity tests (tests/*/test_warm*.py,
test_preload.py): written as JSON to $PROBE_OUT, then argv[1] says how to end."""

import json
import os
import signal
import sys
import time


def state() -> dict:
    g = globals()
    spec = g.get("__spec__")
    sigs = {}
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        sigs[str(int(sig))] = (
            handler if isinstance(handler, int) else getattr(handler, "__name__", repr(handler))
        )
    streams = {}
    for name in ("stdin", "stdout", "stderr"):
        s = getattr(sys, name)
        streams[name] = (
            None
            if s is None
            else {
                "same_as_dunder": s is getattr(sys, f"__{name}__"),
                "fileno": s.fileno(),
                "isatty": s.isatty(),
                "encoding": s.encoding,
                "errors": s.errors,
                "line_buffering": s.line_buffering,
                "write_through": s.write_through,
                "mode": s.mode,
                "name": s.name,
                "buffer": type(s.buffer).__name__,
                "raw_name": getattr(getattr(s.buffer, "raw", s.buffer), "name", None),
            }
        )
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    return {
        "argv": sys.argv,
        "orig_argv": getattr(sys, "orig_argv", None),
        "path0": sys.path[0],
        "file": g.get("__file__"),
        "name": __name__,
        "spec": None if spec is None else [spec.name, spec.origin],
        "loader": type(g.get("__loader__")).__name__,
        "main_keys": [k for k in g if k.startswith("__")],
        "main_is_module": sys.modules["__main__"].__dict__ is g,
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "fds": fds,
        "pgid_is_pid": os.getpgid(0) == os.getpid(),
        "sid_is_pid": os.getsid(0) == os.getpid(),
        "signals": sigs,
        "streams": streams,
        "flags": repr(sys.flags),
        "executable": sys.executable,
    }


def fail() -> None:
    raise ValueError("probe failed on purpose")


if __name__ == "__main__":
    out = os.environ.get("PROBE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(state(), f, indent=1, sort_keys=True)
    how = sys.argv[1] if len(sys.argv) > 1 else "ok"
    print(f"probe {how} pid {os.getpid()}", flush=True)
    print("probe stderr line", file=sys.stderr, flush=True)
    if how == "exit3":
        sys.exit(3)
    if how == "exitmsg":
        sys.exit("probe says bye")
    if how == "raise":
        fail()
    if how == "kbint":
        raise KeyboardInterrupt
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
    if how == "hold":
        time.sleep(60)
