"""Snapshots of a plain PyTorch loop: model, optimizer, torch's random generators, a few extras.

    from node_agent.worker import snapshot_torch

    loaded = snapshot_torch.load(model=model, optimizer=opt)     # None: nothing to restore
    start = loaded.step + 1 if loaded else 0
    epoch = loaded.extra["epoch"] if loaded else 0
    for step in range(start, steps):
        train_step()
        if step % 100 == 0:
            snapshot_torch.save(step, model=model, optimizer=opt, epoch=epoch)

``save`` writes one ``torch.save`` of ``{"step", "model", "optimizer", "extra", "rng"}`` through
``worker.snapshot(step)``: the state dicts as they are (tensors on a GPU are copied out by
``torch.save``), ``extra`` the keyword arguments, ``rng`` torch's CPU generator state and, once
this process has initialised CUDA, every CUDA device's. ``load`` puts them back, so a resumed
run draws the same random numbers (dropout, shuffling through torch) as an uninterrupted one.

``load`` unpickles with ``torch.load(weights_only=True)``: tensors, state dicts, torch's RNG
states and plain Python values (what ``save`` writes with plain extras) and nothing else, so a
file that would run code when unpickled raises :class:`UnsafeSnapshot` instead (the file may
be a peer's replica or come from ``--snapshot-dir``). Extras of other types are allowed by
naming them: ``load(safe_globals=[MyConfig])``. ``weights_only=False`` unpickles anything,
trusting every place the file may come from: not recommended. The other loaders we ship
(``hf_snapshots``, ``lightning_snapshots``) read through :func:`safe_load` too.
Outside node-agent ``save`` serialises and discards, and ``load`` returns None.

torch is imported inside the functions only: importing this module costs nothing more than
``node_agent.worker.snapshots``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _as_step
from .snapshots import restore, snapshot

__all__ = ["Loaded", "UnsafeSnapshot", "load", "safe_load", "save"]


class UnsafeSnapshot(RuntimeError):
    """A snapshot file holds a type a weights only load does not allow (a pickle that could run
    code when unpickled, or a type the script did not name in ``safe_globals``): not loaded."""


def safe_load(
    path: str, *, safe_globals: Sequence[Any] = (), map_location: Any = "cpu", mmap: bool = False
) -> Any:
    """``torch.load(path, weights_only=True)``, with ``safe_globals`` (classes and functions)
    allowed beside torch's own (tensors, state dicts, plain Python values). A file that needs
    anything else raises :class:`UnsafeSnapshot`, before any of it runs."""
    import pickle

    torch = _torch()
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        why = _reason(str(exc))
        raise UnsafeSnapshot(
            f"the snapshot {path} holds what a weights only load does not allow ({why}); if the "
            "script saved it and trusts every place it may come from, name the type in safe_globals"
        ) from exc


def _reason(text: str) -> str:
    """The line of torch's refusal that says what was refused (its message also explains
    weights_only and points to its docs)."""
    if "WeightsUnpickler error:" in text:
        why = text.split("WeightsUnpickler error:", 1)[1].split("\n\n", 1)[0]
    else:
        paras = [p for p in text.split("\n\n") if p.strip()]
        rest = [p for p in paras[1:] if not p.strip().startswith("Check the documentation")]
        why = rest[0] if rest else paras[0] if paras else ""
    why = " ".join(why.replace("\x1b[1m", "").replace("\x1b[0m", "").split())
    return why if len(why) <= 300 else why[:297] + "..."


@dataclass(frozen=True)
class Loaded:
    """What ``load`` restored: the step (resume at ``step + 1``) and ``save``'s extras."""

    step: int
    extra: dict[str, Any] = field(default_factory=dict)


def save(
    step: int, *, model: Any = None, optimizer: Any = None, replicated: bool = False, **extra: Any
) -> None:
    """Snapshot ``model``'s and ``optimizer``'s state dicts, torch's RNG states and ``extra``
    as this rank's state at ``step``. ``replicated=True``: every rank holds this state alike
    (DDP), so a job that shrinks or grows restores from it too (``worker.snapshot``)."""
    step = _as_step(step, "snapshot_torch.save")
    torch = _torch()
    state = {
        "step": step,
        "model": None if model is None else model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "extra": extra,
        "rng": _rng_state(torch),
    }
    with snapshot(step, replicated=replicated) as f:
        torch.save(state, f)


def load(
    *,
    model: Any = None,
    optimizer: Any = None,
    map_location: Any = "cpu",
    safe_globals: Sequence[Any] = (),
    weights_only: bool = True,
) -> Loaded | None:
    """Restore the step the job resumes from into ``model`` and ``optimizer``, and torch's RNG
    states; None when there is nothing to restore (the objects are then left as they are).
    Raises ``SnapshotMissing`` when a step is chosen and this rank has no snapshot of it, and
    ``UnsafeSnapshot`` when the file holds a type other than torch's weights only ones and
    ``safe_globals`` (``weights_only=False``: anything is unpickled, not recommended)."""
    r = restore()
    if r is None:
        return None
    torch = _torch()
    if weights_only:
        state = safe_load(r.path, safe_globals=safe_globals, map_location=map_location)
    else:
        state = torch.load(r.path, map_location=map_location, weights_only=False)
    if not isinstance(state, dict) or state.get("step") != r.step or "rng" not in state:
        raise RuntimeError(f"{r.path} is not a snapshot_torch.save() snapshot of step {r.step}")
    for name, obj in (("model", model), ("optimizer", optimizer)):
        if obj is not None:
            if state.get(name) is None:
                raise RuntimeError(f"the snapshot of step {r.step} ({r.path}) holds no {name} state")
            obj.load_state_dict(state[name])
    _set_rng_state(torch, state["rng"])
    return Loaded(r.step, dict(state.get("extra") or {}))


def _torch() -> Any:
    # By name: the type checker stays out of torch (minutes of analysis for a few calls).
    return importlib.import_module("torch")


def _rng_state(torch: Any) -> dict[str, Any]:
    # CUDA's generators only once this process started CUDA: before that they were never used,
    # and asking for them would create a context on every visible device.
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _set_rng_state(torch: Any, rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["cpu"].cpu())  # a map_location may have moved it off the CPU
    cuda = rng.get("cuda") or []
    if cuda and torch.cuda.is_available():
        for device, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), device)
