"""A worker that records the signals it receives, for the step-signal tests.

Environment: SIGNAL_DIR (where it writes), HANDLE (comma-separated signal names it handles;
default SIGUSR1,SIGTERM), HOLD_S (how long it waits for ``<dir>/go`` before it ends; default 60).
Files, per rank: ``rank<R>.started`` (a line per start), ``rank<R>.ready`` (its handlers are
in), ``rank<R>.signals`` (a line per signal received), ``rank<R>.dispositions`` (SIGUSR1,
SIGTERM and SIGINT's handlers at start, as a cold worker has them). A SIGTERM ends it with
143 after 0.5 s, time for a second one to arrive.
"""

import os
import signal
import sys
import time

out = os.environ["SIGNAL_DIR"]
rank = os.environ.get("RANK", "0")
handled = [s for s in os.environ.get("HANDLE", "SIGUSR1,SIGTERM").split(",") if s]


def path(what: str) -> str:
    return os.path.join(out, f"rank{rank}.{what}")


def note(what: str, line: str) -> None:
    with open(path(what), "a") as f:
        f.write(line + "\n")


def shown(handler: object) -> str:
    if handler is signal.default_int_handler:
        return "python"
    return {signal.SIG_DFL: "default", signal.SIG_IGN: "ignored"}.get(handler, "other")  # type: ignore[call-overload]


note("started", str(os.getpid()))
watched = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
note("dispositions", " ".join(f"{s.name}={shown(signal.getsignal(s))}" for s in watched))
terminating = False


def on_signal(signum: int, _frame: object) -> None:
    global terminating
    note("signals", signal.Signals(signum).name)
    if signum == signal.SIGTERM:
        terminating = True


for name in handled:
    signal.signal(signal.Signals[name], on_signal)
note("ready", "1")
deadline = time.monotonic() + float(os.environ.get("HOLD_S", "60"))
end_at = None
while time.monotonic() < deadline:
    if terminating and end_at is None:
        end_at = time.monotonic() + 0.5
    if end_at is not None and time.monotonic() >= end_at:
        sys.exit(143)
    if os.path.exists(os.path.join(out, "go")):
        sys.exit(0)
    time.sleep(0.02)
sys.exit(3)
