"""PyTorch Lightning reports its progress to node-agent: one line in the script.

    from node_agent.worker.lightning import ProgressCallback

    trainer = Trainer(..., callbacks=[ProgressCallback()])

Works with ``lightning`` (``lightning.pytorch.Trainer``) and with ``pytorch_lightning``: the class
is a ``Callback`` of each of the two that is installed (importing the second costs about 0.2 s
once the first is loaded). Outside node-agent it does nothing.

What it reports (see ``node_agent.worker``):

* ``progress(trainer.global_step)`` at the end of every training batch: the step is the number
  of optimizer steps done (with gradient accumulation, several batches report the same step;
  the agent counts each report as progress);
* phases: "setup" from the trainer's setup of ``fit`` to the start of training (checkpoint
  restore, sanity check); "compute" for the forward pass and the optimizer step; "backward" for
  the backward pass, which is left out of "compute" because under DDP it holds the gradient
  all-reduce, where a fast rank waits for the slow one (the straggler score compares "compute"
  time); "eval" during validation; "checkpoint" from the checkpoint's assembly
  (``on_save_checkpoint``) until the next hook, which covers writing it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from . import _PhaseStack, progress

__all__ = ["ProgressCallback"]

PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _callback_bases() -> tuple[type, ...]:
    bases = []
    for name in PACKAGES:
        try:
            if importlib.util.find_spec(name.split(".")[0]) is None:
                continue
            bases.append(importlib.import_module(name).Callback)
        except ImportError:
            continue
    if not bases:
        raise ImportError("node_agent.worker.lightning needs lightning or pytorch_lightning installed")
    return tuple(bases)


class _Hooks:
    """The hooks (Lightning calls them by name; the Callback bases provide every other one)."""

    def __init__(self) -> None:
        self._phases = _PhaseStack()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._phases.clear()
            self._phases.push("setup")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._phases.clear()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._phases.clear()
        self._phases.push("compute")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._phases.leave("compute")
        self._phases.push("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._phases.leave("backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._phases.leave("backward")
        if "compute" not in self._phases:
            self._phases.push("compute")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._phases.clear()
        progress(int(trainer.global_step))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._phases.leave("checkpoint")
        self._phases.push("eval")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._phases.leave("eval")

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        if "checkpoint" not in self._phases:
            self._phases.push("checkpoint")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._phases.leave("checkpoint")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._phases.clear()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._phases.clear()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._phases.clear()


ProgressCallback: type = type(
    "ProgressCallback",
    (_Hooks, *_callback_bases()),
    {
        "__module__": __name__,
        "__qualname__": "ProgressCallback",
        "__doc__": "Reports training steps and phases to node-agent (``callbacks=[ProgressCallback()]``).",
    },
)
