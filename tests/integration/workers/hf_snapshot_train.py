"""A Hugging Face Trainer run under node-agent with ``SnapshotCallback`` and
``resume_checkpoint()``: the two lines a script adds (the rest records what the test checks).

Each rank trains a tiny model (a linear layer with dropout in a ``PreTrainedModel``, built
here: no download) with AdamW and a linear schedule under DDP (gloo, CPU) for $STEPS steps on
random data made here. Rank $FAULT_RANK SIGKILLs itself after its snapshot of step
$FAULT_STEP, once per job (a marker file in $DUMP_DIR). With IN_PLACE=1 the script's entry
is ``worker.run(main)`` (restarts in place: the survivor trains again in its process). Each
process appends {"restart", "start", "pid"} to $DUMP_DIR/starts-<rank>.jsonl; the last one
saves the parameters to $DUMP_DIR/final-<rank>.pt.
"""

import json
import os
import signal
import sys

import torch
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

from node_agent.worker.hf_snapshots import SnapshotCallback, resume_checkpoint

steps = int(os.environ.get("STEPS", "12"))
dump = os.environ["DUMP_DIR"]
fault_step = int(os.environ.get("FAULT_STEP", "-1"))
fault_rank = int(os.environ.get("FAULT_RANK", "1"))
rank = int(os.environ.get("RANK", "0"))


class TinyConfig(PretrainedConfig):
    model_type = "tiny-linear-snap"


class Tiny(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.layer = torch.nn.Linear(8, 1)
        self.drop = torch.nn.Dropout(0.1)
        self.post_init()

    def forward(self, x, labels=None):
        out = self.layer(self.drop(x))
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) / 3

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Record(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        with open(os.path.join(dump, f"starts-{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"restart": restart, "start": state.global_step, "pid": os.getpid()}) + "\n")

    def on_step_end(self, args, state, control, **kwargs):
        marker = os.path.join(dump, "killed")
        if rank == fault_rank and state.global_step == fault_step and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    global rank
    rank = int(os.environ.get("RANK", "0"))  # (this attempt's: in place, the next may differ)
    args = TrainingArguments(
        output_dir=sys.argv[1],
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        lr_scheduler_type="linear",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=7,
    )
    torch.manual_seed(0)  # the same initial weights in every run
    trainer = Trainer(
        model=Tiny(TinyConfig()),
        args=args,
        train_dataset=Data(16 * steps),
        callbacks=[SnapshotCallback(every_n_steps=1), Record()],
    )
    trainer.train(resume_from_checkpoint=resume_checkpoint())
    model = trainer.model
    params = [p.detach().clone() for p in model.parameters()]
    torch.save(params, os.path.join(dump, f"final-{rank}.pt"))
    print(f"done {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    if os.environ.get("IN_PLACE") == "1":
        from node_agent import worker

        worker.run(main)  # restarts in place: a survivor trains again in this process
    else:
        main()
