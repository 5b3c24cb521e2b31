"""PyTorch Lightning keeps in-memory snapshots under node-agent: two lines in the script.

    from node_agent.worker.lightning_snapshots import SnapshotCallback, resume_path

    trainer = Trainer(..., callbacks=[SnapshotCallback(every_n_steps=100)])
    trainer.fit(model, ckpt_path=resume_path())

``SnapshotCallback`` writes the checkpoint Lightning itself would write (model, optimizers,
schedulers, loops, callbacks' states, precision plugin: ``dump_checkpoint`` of the trainer's
checkpoint connector, with the optimizer states) through ``worker.snapshot(global_step)`` at
the end of a training batch whose ``trainer.global_step`` is a multiple of ``every_n_steps``
and advanced since the last snapshot. ``resume_path()`` is the path of the snapshot the job
restores from, or None, which ``ckpt_path`` takes as "start afresh".

``resume_path()`` first unpickles the file with ``torch.load(weights_only=True, mmap=True)``
(``snapshot_torch.safe_load``: the tensors are mapped, not copied), allowing beside torch's own
types only ``argparse.Namespace`` (hyper-parameters saved from parsed arguments) and what the
caller names in ``safe_globals``, and raises ``snapshot_torch.UnsafeSnapshot`` for a file that
needs anything else (a pickle that would run code): Lightning only ever gets a file that loads
that way. The allowed types are also registered with ``torch.serialization.add_safe_globals``,
so Lightning's own load of it works with ``weights_only=True`` (torch's default; pass
``trainer.fit(..., weights_only=True)`` where Lightning has it). Hyper-parameters of other
types (an ``Enum``, a ``Path``) need ``resume_path(safe_globals=[...])``; OmegaConf's are not
supported.

Works with ``lightning`` and with ``pytorch_lightning``, like ``node_agent.worker.lightning``.
Outside node-agent (no snapshot directory) the callback does nothing, not even serialise, and
``resume_path()`` is None. Not saved: the data loader's position within an epoch beyond what Lightning's loops
record, and random generators (Lightning's checkpoint holds none: seed with
``seed_everything`` and a stateless sampler for bit-identical resumes).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any

from .lightning import _callback_bases
from .snapshot_torch import safe_load
from .snapshots import _directory, restore, snapshot

__all__ = ["ALLOWED_GLOBALS", "SnapshotCallback", "resume_path"]

# What a Lightning checkpoint may hold beside torch's weights only types: its hyper-parameters
# are a plain dict, often of parsed arguments. Everything else in it (state dicts, loops',
# callbacks' and precision plugin's states) is tensors and plain Python values.
ALLOWED_GLOBALS: tuple[Any, ...] = (argparse.Namespace,)


def _every(every_n_steps: object) -> int:
    if type(every_n_steps) is not int or every_n_steps < 1:
        raise ValueError(f"every_n_steps must be a positive int, not {every_n_steps!r}")
    return every_n_steps


def resume_path(*, safe_globals: Sequence[Any] = ()) -> str | None:
    """The snapshot file to pass as ``trainer.fit(..., ckpt_path=resume_path())``; None when
    there is nothing to restore (or outside node-agent). ``UnsafeSnapshot`` when the file does
    not load with ``weights_only=True`` (``ALLOWED_GLOBALS`` and ``safe_globals`` allowed)."""
    r = restore()
    if r is None:
        return None
    allowed = [*ALLOWED_GLOBALS, *safe_globals]
    safe_load(r.path, safe_globals=allowed, mmap=True)  # refused here, before Lightning reads it
    importlib.import_module("torch").serialization.add_safe_globals(allowed)  # for Lightning's load
    return r.path


class _Hooks:
    def __init__(self, every_n_steps: int = 1) -> None:
        self.every_n_steps = _every(every_n_steps)
        self._last: int | None = None

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = int(trainer.global_step)
        if step % self.every_n_steps or step == self._last or _directory() is None:
            return
        self._last = step
        # By name: the type checker stays out of torch. A worker running Lightning has it loaded already.
        torch = importlib.import_module("torch")

        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        with snapshot(step) as f:
            torch.save(checkpoint, f)


SnapshotCallback: type = type(
    "SnapshotCallback",
    (_Hooks, *_callback_bases()),
    {
        "__module__": __name__,
        "__qualname__": "SnapshotCallback",
        "__doc__": "Snapshots the trainer's checkpoint every ``every_n_steps`` optimizer steps "
        "(``callbacks=[SnapshotCallback(every_n_steps=100)]``).",
    },
)
