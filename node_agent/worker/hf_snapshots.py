"""Hugging Face ``transformers.Trainer`` keeps in-memory snapshots under node-agent: two lines.

    from node_agent.worker.hf_snapshots import SnapshotCallback, resume_checkpoint

    trainer = Trainer(..., callbacks=[SnapshotCallback(every_n_steps=100)])
    trainer.train(resume_from_checkpoint=resume_checkpoint())

``SnapshotCallback`` writes, at the end of an optimizer step (``on_step_end``) whose
``state.global_step`` is a multiple of ``every_n_steps``, one ``torch.save`` of the model's
state dict, the optimizer's and the learning-rate scheduler's state dicts, the ``TrainerState``
(as the JSON the Trainer writes) and the random generators (torch's CPU generator, every CUDA
device's once CUDA is initialised, Python's ``random``, numpy's) through
``worker.snapshot(global_step)``. ``resume_checkpoint()`` turns the snapshot the job restores
from into a checkpoint folder the Trainer reads (``pytorch_model.bin``, ``optimizer.pt``,
``scheduler.pt``, ``trainer_state.json``, ``rng_state.pth`` and ``rng_state_<rank>.pth``) in a
new temporary directory, or returns None when there is nothing to restore.

``resume_checkpoint()`` unpickles the snapshot with ``torch.load(weights_only=True)``
(``snapshot_torch.safe_load``) allowing, beside torch's own types, only numpy's array
reconstruction (``numpy._core.multiarray._reconstruct``, ``numpy.ndarray``, ``numpy.dtype`` and
the ``uint32`` dtype's class: numpy's generator state, as the Trainer allows for its own
``rng_state.pth``) and what the caller names in ``safe_globals``; a file that would run code
raises ``snapshot_torch.UnsafeSnapshot``.

Outside node-agent (no snapshot directory) the callback does nothing, not even serialise, and
``resume_checkpoint()`` is None. Not saved: a gradient scaler's state (mixed precision with
``fp16``), states that DeepSpeed or FSDP shard, and the configuration (the script builds the
same model). The temporary folder is the caller's to remove once training has started.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import random
import tempfile
from collections.abc import Sequence
from typing import Any

from .snapshot_torch import safe_load
from .snapshots import _directory, restore, snapshot

# By name, as in node_agent.worker.hf: the type checker stays out of transformers.
TrainerCallback: Any = importlib.import_module("transformers").TrainerCallback

__all__ = ["SnapshotCallback", "resume_checkpoint"]

FORMAT = "node-agent-hf-snapshot-1"


def _every(every_n_steps: object) -> int:
    if type(every_n_steps) is not int or every_n_steps < 1:
        raise ValueError(f"every_n_steps must be a positive int, not {every_n_steps!r}")
    return every_n_steps


def _rng_state(torch: Any) -> dict[str, Any]:
    rng: dict[str, Any] = {"python": random.getstate(), "cpu": torch.random.get_rng_state()}
    try:
        import numpy

        rng["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.random.get_rng_state_all()
    return rng


class SnapshotCallback(TrainerCallback):
    """Snapshots the Trainer's state every ``every_n_steps`` optimizer steps
    (``callbacks=[SnapshotCallback(every_n_steps=100)]``)."""

    def __init__(self, every_n_steps: int = 1) -> None:
        self.every_n_steps = _every(every_n_steps)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        if step % self.every_n_steps or _directory() is None:
            return
        # By name: the type checker stays out of torch. A worker running the Trainer has it loaded already.
        torch = importlib.import_module("torch")

        model, optimizer, scheduler = kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        if model is None:
            raise RuntimeError("the Trainer passed no model to SnapshotCallback.on_step_end")
        model = getattr(model, "module", model)  # DDP's wrapper
        record = {
            "format": FORMAT,
            "step": step,
            "model": model.state_dict(),
            "optimizer": None if optimizer is None else optimizer.state_dict(),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
            "rng": _rng_state(torch),
        }
        with snapshot(step) as f:
            torch.save(record, f)


def allowed_globals() -> list[Any]:
    """What a snapshot of :class:`SnapshotCallback` holds beside torch's weights only types:
    numpy's generator state (an ``ndarray`` of ``uint32``). The Trainer's state is JSON text,
    Python's generator state plain tuples and ints."""
    try:
        import numpy
    except ImportError:
        return []
    core = getattr(numpy, "_core", None) or numpy.core  # numpy 2 moved it
    return [core.multiarray._reconstruct, numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))]


def resume_checkpoint(*, safe_globals: Sequence[Any] = ()) -> str | None:
    """A checkpoint folder made from the snapshot the job restores from, for
    ``trainer.train(resume_from_checkpoint=resume_checkpoint())``; None when there is nothing
    to restore (or outside node-agent). The snapshot is read with ``weights_only=True``
    (:func:`allowed_globals` and ``safe_globals`` allowed): ``UnsafeSnapshot`` otherwise."""
    r = restore()
    if r is None:
        return None
    torch = importlib.import_module("torch")
    record = safe_load(r.path, safe_globals=[*allowed_globals(), *safe_globals])
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("step") != r.step:
        raise RuntimeError(f"{r.path} is not a hf_snapshots.SnapshotCallback snapshot of step {r.step}")
    folder = tempfile.mkdtemp(prefix=f"node-agent-hf-step{r.step}-")
    torch.save(record["model"], os.path.join(folder, "pytorch_model.bin"))
    for name, key in (("optimizer.pt", "optimizer"), ("scheduler.pt", "scheduler")):
        if record[key] is not None:
            torch.save(record[key], os.path.join(folder, name))
    with open(os.path.join(folder, "trainer_state.json"), "w", encoding="utf-8") as f:
        f.write(record["trainer_state"])
    rng = record["rng"]
    if "numpy" not in rng:  # the Trainer sets numpy's state unconditionally
        import numpy

        rng["numpy"] = numpy.random.get_state()
    # The Trainer reads rng_state_<process index>.pth in a distributed run (every device's CUDA
    # state), rng_state.pth alone otherwise (the current device's).
    torch.save(rng, os.path.join(folder, f"rng_state_{int(os.environ.get('RANK', '0'))}.pth"))
    if isinstance(rng.get("cuda"), list):
        rng["cuda"] = rng["cuda"][torch.cuda.current_device()] if rng["cuda"] else None
        if rng["cuda"] is None:
            del rng["cuda"]
    torch.save(rng, os.path.join(folder, "rng_state.pth"))
    return folder
