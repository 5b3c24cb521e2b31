"""The agent's store process: torch's own TCPStore, served on a socket the agent listens on.

Run by the WORKERS' interpreter (``python -u -c <this file's text> FD PORT``), never imported by
the agent, so it imports nothing of ``node_agent`` and keeps to what an older Python (3.6)
runs (its signatures' annotations are strings). FD is the agent's listening socket on
MASTER_PORT (PORT), inherited. The agent writes commands on stdin, one per line; the process
answers on stdout, one line each:

* at start, at once: ``found <torch version>``, or ``unusable <why>`` and exit (no torch, or a
  torch whose TCPStore cannot serve a socket it is given: ``master_listen_fd`` with libuv came
  in torch 2.8). torch itself is imported on the first command that needs it, so a node that
  never hosts a round never pays for it: then ``ready``, or ``unusable <why>`` and exit;
* ``import``: import torch now (``--preload torch``: the first round's store is ready early);
* ``fresh <n>``: drop the last store (its keys and connections) and serve a new, empty one on
  the same listening socket; ``serving <n>``, or ``error <n> <why>``;
* ``drop <n>``: the round is over: drop its store and serve nothing (``dropped <n>``). The agent
  sends it before its next Join, so that a new round's worker (another node's can start the
  moment the round forms, before this node serves the new store) waits in the backlog instead
  of reaching the old store, which would close its connection on ``fresh``.

The socket listens from before any worker starts, so a worker that connects before the store
is served waits in the kernel's backlog (no refused connect, so no retry sleep in torch) and is
answered once it is. Each round gets an empty store: a restarted round's workers use the same
keys as the last one's (torch prefixes none per attempt when TORCHELASTIC_USE_AGENT_STORE=True).

EOF on stdin (the agent exited, however) ends the process; the agent also sets
PR_SET_PDEATHSIG, so it never outlives the agent.
"""

import datetime
import os
import sys
from typing import Any

MIN_TORCH = (2, 8)  # the same as store/host.py's MIN_TORCH: this file imports nothing of node_agent


def _say(line: str) -> None:
    sys.stdout.write(line.replace("\n", " ")[:1000] + "\n")
    sys.stdout.flush()


def _version_tuple(text: str) -> "tuple[int, ...]":
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    return tuple(parts)


# The signals a scheduler sends to every process of a job step (procutil.STEP_SIGNALS): this
# process outlives them and ends by the agent's word or its stdin closing. The agent's
# preexec_fn ignored them already, but libuv (uvloop, the agent's loop) resets every
# disposition after it: so again here, first thing.
STEP_SIGNALS = (1, 2, 3, 10, 12, 15)


def main(argv: "list[str]") -> int:
    import signal

    for signum in STEP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    fd, port = int(argv[1]), int(argv[2])
    # `-c` put the working directory first on sys.path: a file there must not shadow torch.
    if sys.path and sys.path[0] == "":
        del sys.path[0]
    import importlib.util

    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError) as exc:
        found, why = False, f"looking for torch failed: {exc}"
    else:
        why = f"no torch in {sys.executable}"
    if not found:
        _say("unusable " + why)
        return 3
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:  # metadata missing: the import below decides
        torch_version = "unknown"
    if torch_version != "unknown" and _version_tuple(torch_version) < MIN_TORCH:
        _say(f"unusable torch {torch_version} cannot serve a given socket (needs >= 2.8)")
        return 3
    _say("found " + torch_version)
    # torch itself is imported only when needed (`import`, or the first `fresh`): a node that
    # never hosts a round (every node but group rank 0's) never pays its memory and CPU.
    TCPStore: Any = None
    served: list[object] = []  # the round's store, alive while referenced
    for line in sys.stdin:
        words = line.split()
        if len(words) == 2 and words[0] == "drop":
            served.clear()  # the only reference: the store's server stops and its connections close
            _say("dropped " + words[1])
            continue
        if words == ["import"] or (len(words) == 2 and words[0] == "fresh"):
            if TCPStore is None:
                try:
                    from torch.distributed import TCPStore
                except BaseException as exc:  # any failure of the import is a verdict, not a crash
                    _say(f"unusable importing torch.distributed failed: {type(exc).__name__}: {exc}")
                    return 3
                _say("ready")
            if words[0] == "import":
                continue
        else:
            _say(f"error - unknown command {line[:100]!r}")
            continue
        tag = words[1]
        # A store's own wait on a client (after the agent is gone nobody waits for it).
        timeout = datetime.timedelta(seconds=1800)
        # The last round's store closes its connections and its copy of the socket before the
        # new one is made: ``served`` holds the only reference (no local name keeps it), else two
        # servers would accept on the one socket while the new one starts.
        served.clear()
        try:
            # TCPStore closes the descriptor it serves when it goes: give it a copy.
            # The master's own client connects to it through the loopback.
            served.append(
                TCPStore(
                    "127.0.0.1",
                    port,
                    is_master=True,
                    master_listen_fd=os.dup(fd),
                    use_libuv=True,
                    wait_for_workers=False,
                    timeout=timeout,
                )
            )
        except Exception as exc:
            _say(f"error {tag} {type(exc).__name__}: {exc}")
            continue
        _say("serving " + tag)
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv)
    except KeyboardInterrupt:
        code = 130
    os._exit(code)  # no interpreter teardown: the store's threads need no goodbye
