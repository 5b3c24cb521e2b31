"""Hugging Face ``transformers.Trainer`` reports its progress to node-agent: one line in the script.

    from node_agent.worker.hf import ProgressCallback

    trainer = Trainer(..., callbacks=[ProgressCallback()])

Outside node-agent it does nothing. What it reports (see ``node_agent.worker``):

* ``progress(state.global_step)`` at the end of every optimizer step (``on_step_end``);
* phases: "setup" from the Trainer's construction to the start of the training loop (dataset
  preparation in between, model wrapping, checkpoint restore); "compute" for a whole optimizer
  step (every micro-batch's forward and backward, then the optimizer: the Trainer has no hook
  around the backward pass, so under DDP this includes the gradient all-reduce, which evens out
  ranks' compute times: the straggler score is weaker than with a plain loop or Lightning);
  "eval" and "checkpoint" for the evaluation and the save that the Trainer runs after a step
  (the Trainer has hooks only at their end: they are entered at ``on_step_end`` or
  ``on_epoch_end`` when the Trainer's control says one comes next, and left by ``on_evaluate``
  and ``on_save``).
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _PhaseStack, progress

# Imported by name: the type checker then stays out of transformers (half a minute of analysis,
# and its annotations change between releases; these hooks take whatever it passes).
TrainerCallback: Any = importlib.import_module("transformers").TrainerCallback

__all__ = ["ProgressCallback"]


class ProgressCallback(TrainerCallback):
    """Reports training steps and phases to node-agent (``callbacks=[ProgressCallback()]``)."""

    def __init__(self) -> None:
        self._phases = _PhaseStack()

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.clear()
        self._phases.push("setup")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.clear()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.clear()
        self._phases.push("compute")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.clear()
        progress(int(state.global_step))
        self._next(control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.clear()
        self._next(control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.leave("eval")
        if control.should_save and "checkpoint" not in self._phases:
            self._phases.push("checkpoint")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.leave("checkpoint")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.clear()

    def _next(self, control: Any) -> None:
        """The Trainer evaluates, then saves, right after this hook when its control says so
        (its flow callback, which sets them, runs before ours)."""
        if control.should_evaluate:
            self._phases.push("eval")
        elif control.should_save:
            self._phases.push("checkpoint")
