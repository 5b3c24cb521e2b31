"""A tiny Lightning fit on CPU whose only node-agent line is ``callbacks=[ProgressCallback()]``.

$STEPS optimizer steps of a linear model on random data made here (no download), a validation
every 4 batches and a checkpoint every 5 steps, so that every phase the callback names happens.
$LIGHTNING picks the package: "lightning" (default) or "pytorch_lightning". At the end it prints
"done <step>" and "phases <json>": the phase the page showed in each of the module's hooks (the
test's view; a user's script needs none of it).
"""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from node_agent.progress.pages import read_page
from node_agent.worker.lightning import ProgressCallback

if os.environ.get("LIGHTNING", "lightning") == "pytorch_lightning":
    import pytorch_lightning as pl
else:
    import lightning.pytorch as pl


SEEN: set[tuple[str, str]] = set()


def seen(where: str) -> None:
    page = os.environ.get("NODE_AGENT_PROGRESS_PAGE")
    sample = read_page(page) if page else None
    SEEN.add((where, sample.phase if sample else "?"))


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def setup(self, stage):
        seen("setup")

    def training_step(self, batch, batch_idx):
        seen("training_step")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def backward(self, loss, *args, **kwargs):
        seen("backward")
        super().backward(loss, *args, **kwargs)

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)  # runs the closure (forward, backward), then steps
        seen("after optimizer_step")

    def on_save_checkpoint(self, checkpoint):
        seen("on_save_checkpoint")

    def validation_step(self, batch, batch_idx):
        seen("validation_step")
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    steps = int(os.environ.get("STEPS", "12"))
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    every = pl.callbacks.ModelCheckpoint(dirpath=sys.argv[1], every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=4,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        callbacks=[ProgressCallback(), every],
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    print(f"done {trainer.global_step}", flush=True)
    print("phases " + json.dumps(sorted(SEEN)), flush=True)
    if os.environ.get("PAGE_COPY"):  # the agent removes its private folder when it ends
        with open(os.environ["NODE_AGENT_PROGRESS_PAGE"], "rb") as src:
            page = src.read()
        with open(os.environ["PAGE_COPY"], "wb") as dst:
            dst.write(page)


if __name__ == "__main__":
    main()
