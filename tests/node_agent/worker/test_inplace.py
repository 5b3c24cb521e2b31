"""``worker.run`` (issue 44: restarts in place), in this process: the agent's side is played by
a thread that writes the orders into a place folder and sends the park signal, as
``supervisor/parking.py`` does.

- Outside node-agent ``run(train)`` is ``train()``.
- A park interrupts the attempt (``Interrupted``, which ``except Exception`` does not catch);
  the process waits parked, takes the next place's environment (and drops what the agent no
  longer sets) and calls ``train()`` again; its return value is ``run``'s.
- A rank's own exception propagates at once; one of the kind a peer's death causes waits for a
  park, and with one it is collateral: the attempt runs again.
- ``SystemExit`` propagates; a park signal after ``run`` returned is ignored.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from node_agent import worker
from node_agent.worker import inplace, place

BOUND = 10.0


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(place.PLACE_VAR, str(tmp_path))
    monkeypatch.delenv("NODE_AGENT_PROGRESS_PAGE", raising=False)
    before = signal.getsignal(place.PARK_SIGNAL)
    yield tmp_path
    signal.signal(place.PARK_SIGNAL, before)


def _state(folder: Path) -> dict[str, object]:
    return place.read(str(folder), place.STATE) or {}


def _wait_state(folder: Path, state: str, serial: int = -1) -> None:
    deadline = time.monotonic() + BOUND
    while True:
        s = _state(folder)
        if s.get("state") == state and place.serial_of(s) >= serial:
            return
        assert time.monotonic() < deadline, (state, s)
        time.sleep(0.002)


def _agent(folder: Path, serial: int, env: dict[str, str], unset: list[str] = ()) -> threading.Thread:  # type: ignore[assignment]
    """Park the running attempt (order ``serial``), then give the next place (``serial + 1``)."""

    def play() -> None:
        _wait_state(folder, place.RUNNING)
        place.write(str(folder), place.ORDER, {"serial": serial, "do": place.PARK})
        os.kill(os.getpid(), place.PARK_SIGNAL)
        _wait_state(folder, place.PARKED, serial)
        order = {"serial": serial + 1, "do": place.RUN, "env": env, "unset": list(unset)}
        place.write(str(folder), place.ORDER, order)

    t = threading.Thread(target=play, daemon=True)
    t.start()
    return t


def test_outside_node_agent_run_is_a_plain_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(place.PLACE_VAR, raising=False)
    assert worker.run(lambda a, b=0: a + b, 2, b=3) == 5


def test_a_park_interrupts_the_attempt_and_the_next_place_runs_it_again(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INPLACE_TEST", "first")  # (monkeypatch puts the environment back after)
    monkeypatch.setenv("GONE_NEXT_ROUND", "1")
    calls: list[str] = []
    swallowed: list[BaseException] = []

    def train() -> str:
        calls.append(os.environ["INPLACE_TEST"])
        if calls[-1] == "first":
            deadline = time.monotonic() + BOUND
            while time.monotonic() < deadline:
                try:
                    time.sleep(0.01)
                except Exception as exc:  # a script's broad handler must not swallow the park
                    swallowed.append(exc)
            raise AssertionError("never parked")
        return f"done in {os.environ['INPLACE_TEST']}"

    agent = _agent(folder, 1, {"INPLACE_TEST": "second"}, unset=["GONE_NEXT_ROUND"])
    assert worker.run(train) == "done in second"
    agent.join(BOUND)
    # The park may come before train() is entered (its attempt had begun): then it ran once.
    assert calls in (["first", "second"], ["second"]) and not swallowed
    assert "GONE_NEXT_ROUND" not in os.environ
    assert _state(folder)["state"] == "done"
    # A late park signal, after run returned, is ignored (it would kill by default).
    os.kill(os.getpid(), place.PARK_SIGNAL)


def test_a_rank_s_own_exception_propagates_at_once(folder: Path) -> None:
    def train() -> None:
        raise ValueError("a bug of this rank")

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="a bug of this rank"):
        worker.run(train)
    assert time.monotonic() - t0 < inplace.COLLATERAL_S / 2
    assert _state(folder)["state"] == "done"


def test_an_error_a_peer_s_death_causes_is_collateral_once_the_park_comes(folder: Path) -> None:
    calls: list[int] = []

    def train() -> int:
        calls.append(1)
        if len(calls) == 1:
            _wait_state(folder, place.RUNNING)
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
        return len(calls)

    def agent() -> None:
        _wait_state(folder, place.FAILED)  # the attempt failed and waits for the verdict
        place.write(str(folder), place.ORDER, {"serial": 1, "do": place.PARK})
        _wait_state(folder, place.PARKED, 1)
        place.write(str(folder), place.ORDER, {"serial": 2, "do": place.RUN, "env": {}})

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    assert worker.run(train) == 2
    t.join(BOUND)


@pytest.mark.parametrize(
    ("exc", "collateral"),
    [
        (RuntimeError("Connection closed by peer [127.0.0.1]:4242"), True),
        (RuntimeError("NCCL communicator was aborted"), True),
        (ConnectionResetError("reset by peer"), True),
        (RuntimeError("CUDA out of memory"), False),
        (ValueError("connection"), False),  # not a kind collectives raise
        (KeyError("gloo"), False),
    ],
)
def test_which_errors_may_be_a_peer_s(exc: Exception, collateral: bool) -> None:
    assert inplace._collateral(exc) is collateral


def test_system_exit_propagates_without_waiting(folder: Path) -> None:
    def train() -> None:
        raise SystemExit(7)

    with pytest.raises(SystemExit) as e:
        worker.run(train)
    assert e.value.code == 7


def test_orders_of_an_earlier_process_of_the_rank_are_not_acted_on(folder: Path) -> None:
    # The last process of this local rank was parked by order 5 and died: its order stays.
    place.write(str(folder), place.ORDER, {"serial": 5, "do": place.PARK})
    seen: list[Callable[[], None]] = []

    def train() -> str:
        seen.append(lambda: None)
        return "ran through"

    assert worker.run(train) == "ran through"
    assert len(seen) == 1


def test_a_place_file_past_its_bound_or_of_the_wrong_shape_reads_as_none(tmp_path: Path) -> None:
    """What a worker writes (its state) or the agent (its orders) is read bounded and checked:
    one byte past MAX_FILE, JSON that is not an object, a bad serial or a non-string
    environment count as no file at all."""
    folder = str(tmp_path)
    (tmp_path / place.STATE).write_bytes(
        b'{"pid": 1, "serial": 1, "state": "parked", "pad": "' + b"x" * place.MAX_FILE + b'"}'
    )
    assert place.read(folder, place.STATE) is None
    just = b'{"serial": 3, "pad": "'
    (tmp_path / place.STATE).write_bytes(just + b"x" * (place.MAX_FILE - len(just) - 2) + b'"}')
    assert place.serial_of(place.read(folder, place.STATE)) == 3  # exactly at the bound: read
    for text in (b"[1, 2]", b"not json", b'"parked"'):
        (tmp_path / place.STATE).write_bytes(text)
        assert place.read(folder, place.STATE) is None
    for serial in (-1, True, "3", 1.5):
        assert place.serial_of({"serial": serial}) == -1
    assert place.env_of({"env": {"RANK": 1}}) is None
    assert place.env_of({"env": ["RANK=1"]}) is None
    assert place.env_of({"env": {"RANK": "1"}}) == {"RANK": "1"}


def test_an_attempt_that_returns_at_a_commit_point_waits_for_its_place_then_trains_again(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``should_stop()`` said True (a scale-up or a drain elsewhere): the return is not the
    end; the process says ``committed``, takes the next round's place and trains again, and a
    later plain return is ``run``'s value."""
    monkeypatch.setenv("ROUND", "0")
    seen: list[str] = []

    def train() -> str:
        seen.append(os.environ["ROUND"])
        if len(seen) == 1:
            monkeypatch.setattr(worker, "_stopped", 87)  # what should_stop() leaves at a commit
        return f"done in round {os.environ['ROUND']}"

    def agent() -> None:
        _wait_state(folder, place.COMMITTED)
        order = {"serial": 1, "do": place.RUN, "env": {"ROUND": "1"}, "unset": []}
        place.write(str(folder), place.ORDER, order)

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    # (the next round's page: _rebind, from the place, forgets the commit as it attaches)
    assert worker.run(train) == "done in round 1"
    t.join(BOUND)
    assert seen == ["0", "1"]
    assert _state(folder)["state"] == "done"


def test_a_process_released_after_a_commit_returns_what_its_attempt_returned(folder: Path) -> None:
    """The job goes on without this node (it drains at the commit): the agent's exit order
    lets ``run`` return, so the process exits by itself, output flushed."""
    orders: list[int] = []

    def train() -> int:
        worker._stopped = 12  # type: ignore[attr-defined]
        return 7

    def agent() -> None:
        _wait_state(folder, place.COMMITTED)
        place.write(str(folder), place.ORDER, {"serial": 1, "do": place.EXIT})
        orders.append(1)

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    try:
        assert worker.run(train) == 7
    finally:
        worker._reset()  # type: ignore[attr-defined]
    t.join(BOUND)
    assert orders == [1]


def test_an_exit_order_does_not_release_a_process_parked_after_a_failure(folder: Path) -> None:
    """Only a commit's survivor may end by an exit order: one parked after a restart waits for
    its place (the agent stops it if there is none)."""
    calls: list[int] = []
    inside = threading.Event()

    def train() -> int:
        calls.append(1)
        if len(calls) == 1:
            inside.set()
            while True:
                time.sleep(0.01)
        return 3

    def agent() -> None:
        # Parked inside train(): a park as the attempt begins would come before the first
        # call counted itself (a busy machine did that), and the second would then loop.
        assert inside.wait(BOUND)
        place.write(str(folder), place.ORDER, {"serial": 1, "do": place.PARK})
        os.kill(os.getpid(), place.PARK_SIGNAL)
        _wait_state(folder, place.PARKED, 1)
        place.write(str(folder), place.ORDER, {"serial": 2, "do": place.EXIT})
        time.sleep(0.1)  # (a wrong release would return from run meanwhile)
        assert _state(folder)["state"] == place.PARKED
        place.write(str(folder), place.ORDER, {"serial": 3, "do": place.RUN, "env": {}, "unset": []})

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    assert worker.run(train) == 3
    t.join(BOUND)
    assert calls == [1, 1]


def test_accelerate_forgets_its_process_group_between_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate keeps its process group's state in process-wide singletons: once set up,
    ``Accelerator()`` never calls ``init_process_group`` again, so a survivor's next attempt
    would find none. Between attempts ``worker.run`` empties them (the real accelerate)."""
    state = pytest.importorskip("accelerate.state")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    accelerate = pytest.importorskip("accelerate")
    try:
        accelerate.Accelerator(cpu=True)
        assert state.PartialState._shared_state and state.AcceleratorState._shared_state
        inplace._forget_frameworks()
        assert not state.PartialState._shared_state and not state.AcceleratorState._shared_state
    finally:
        state.AcceleratorState._reset_state(True)
