"""torch's documented ``elastic_launch`` use, run with torch's or with node-agent's
(``python elastic_examples.py torch|ours OUT PORT``), for tests/integration/test_wrappers.py.

The two forms torch's docstring shows, ``elastic_launch(config, worker_fn)(foo)`` and
``elastic_launch(config, "python")("script.py")``, and four ways a launch ends, each written to
OUT as JSON: results of a function launched from another thread (and whether the main thread's
SIGTERM handler is as before), a rank of a script that exits 3 without a word
(``ChildFailedError``), a rendezvous that cannot complete (one node of two, on PORT), and a
script whose rank 0 sends SIGTERM to its launcher (``SignalException``), last, since torch's
agent leaves its handler behind. Only the function's workers import torch (torch's spawn).
"""

import json
import os
import signal
import sys
import threading
import uuid

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wrapped_train.py")


def who(tag: str) -> tuple[str, int, str | None]:
    return tag, int(os.environ["RANK"]), os.environ.get("OMP_NUM_THREADS")


def main(which: str, out: str, port: int) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig

    if which == "torch":
        from torch.distributed.launcher.api import elastic_launch
    else:
        from node_agent import elastic_launch

    def config(nodes: int = 1, endpoint: str = "localhost:0", **kw: object) -> LaunchConfig:
        return LaunchConfig(
            min_nodes=nodes,
            max_nodes=nodes,
            nproc_per_node=2,
            run_id=str(uuid.uuid4()),
            rdzv_backend="c10d",
            rdzv_endpoint=endpoint,
            max_restarts=0,
            monitor_interval=0.05,
            **kw,
        )

    seen: dict[str, object] = {}
    handler = signal.getsignal(signal.SIGTERM)
    box: dict[int, tuple[str, int, str | None]] = {}
    thread = threading.Thread(target=lambda: box.update(elastic_launch(config(), who)("t")))
    thread.start()
    thread.join()
    seen["thread"] = {str(rank): list(value) for rank, value in box.items()}
    seen["handler_kept"] = signal.getsignal(signal.SIGTERM) is handler

    try:
        elastic_launch(config(), sys.executable)("-u", SCRIPT, "fail")
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        seen["child"] = {
            "rank": rank,
            "ranks": sorted(exc.failures),
            "exitcode": failure.exitcode,
            "error_file": failure.error_file,
            "message": failure.message,
        }

    try:
        elastic_launch(config(2, f"127.0.0.1:{port}", rdzv_configs={"join_timeout": 1}), who)("x")
    except RendezvousError as exc:
        seen["rendezvous"] = {"rendezvous_error": True, "type": type(exc).__name__}
    except Exception as exc:
        seen["rendezvous"] = {"rendezvous_error": False, "type": type(exc).__name__, "text": str(exc)}

    try:
        elastic_launch(config(), sys.executable)("-u", SCRIPT, "stop")
    except SignalException as exc:
        seen["signal"] = {
            "sigval": int(exc.sigval),
            "text": str(exc),
            "is_child_failed": isinstance(exc, ChildFailedError),
        }
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
