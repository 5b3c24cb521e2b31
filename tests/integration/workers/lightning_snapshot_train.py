"""A Lightning fit under node-agent with ``SnapshotCallback`` and ``resume_path()``: the two
lines a script adds (the rest records what the test checks).

Each rank trains a linear layer with SGD and momentum under DDP (gloo, CPU) for $STEPS steps; a
step's batch is drawn from a generator seeded by the step and the rank, so the parameters after
step n do not depend on where the data loader stood when the run resumed. Rank $FAULT_RANK
SIGKILLs itself after its snapshot of step $FAULT_STEP, once per job (a marker file in
$DUMP_DIR). With IN_PLACE=1 the script's entry is ``worker.run(main)`` (restarts in place: the
survivor trains again in its process). Each process appends {"restart", "start", "pid"} to
$DUMP_DIR/starts-<rank>.jsonl; the last one saves the parameters to $DUMP_DIR/final-<rank>.pt.
"""

import json
import os
import signal

import torch
from torch.utils.data import DataLoader, TensorDataset

from node_agent.worker.lightning_snapshots import SnapshotCallback, resume_path

if os.environ.get("LIGHTNING", "lightning") == "pytorch_lightning":
    import pytorch_lightning as pl
else:
    import lightning.pytorch as pl

steps = int(os.environ.get("STEPS", "12"))
dump = os.environ["DUMP_DIR"]
fault_step = int(os.environ.get("FAULT_STEP", "-1"))
fault_rank = int(os.environ.get("FAULT_RANK", "1"))
rank = int(os.environ.get("RANK", "0"))


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(1000 * self.trainer.global_step + rank)
        x = torch.randn(4, 8, generator=g)
        y = x.sum(dim=1, keepdim=True) / 3
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Record(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        with open(os.path.join(dump, f"starts-{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"restart": restart, "start": trainer.global_step, "pid": os.getpid()}) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        marker = os.path.join(dump, "killed")
        if rank == fault_rank and trainer.global_step == fault_step and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    global rank
    rank = int(os.environ.get("RANK", "0"))  # (this attempt's: in place, the next may differ)
    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SnapshotCallback(every_n_steps=1), Record()],
    )
    data = DataLoader(TensorDataset(torch.zeros(4 * steps, 1)), batch_size=4)
    model = Tiny()
    trainer.fit(model, data, ckpt_path=resume_path())
    params = [p.detach().clone() for p in model.parameters()]
    torch.save(params, os.path.join(dump, f"final-{rank}.pt"))
    print(f"done {trainer.global_step}", flush=True)


if __name__ == "__main__":
    if os.environ.get("IN_PLACE") == "1":
        from node_agent import worker

        worker.run(main)  # restarts in place: a survivor trains again in this process
    else:
        main()
