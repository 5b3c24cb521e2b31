"""A tiny Hugging Face Trainer run on CPU whose only node-agent line is
``callbacks=[ProgressCallback()]``.

A model built here (no download: a linear layer in a ``PreTrainedModel``) trains $STEPS
optimizer steps on random data, evaluating and saving every 5 steps, so that every phase the
callback names happens. At the end it prints "done <step>" and "phases <json>": the phase the
page showed in the model's forward, in training and in evaluation, and when a checkpoint is
written (the test's view; a user's script needs none of it).
"""

import json
import os
import sys

import torch
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from node_agent.progress.pages import read_page
from node_agent.worker.hf import ProgressCallback

SEEN: set[tuple[str, str]] = set()


def seen(where: str) -> None:
    page = os.environ.get("NODE_AGENT_PROGRESS_PAGE")
    sample = read_page(page) if page else None
    SEEN.add((where, sample.phase if sample else "?"))


class TinyConfig(PretrainedConfig):
    model_type = "tiny-linear"


class Tiny(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.layer = torch.nn.Linear(4, 1)
        self.post_init()

    def forward(self, x, labels=None):
        seen("forward, training" if self.training else "forward, evaluating")
        out = self.layer(x)
        loss = torch.nn.functional.mse_loss(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}

    def save_pretrained(self, *args, **kwargs):
        seen("save_pretrained")
        return super().save_pretrained(*args, **kwargs)


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def main() -> None:
    steps = int(os.environ.get("STEPS", "12"))
    args = TrainingArguments(
        output_dir=sys.argv[1],
        max_steps=steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        eval_strategy="steps",
        eval_steps=5,
        save_strategy="steps",
        save_steps=5,
        logging_steps=5,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=Tiny(TinyConfig()),
        args=args,
        train_dataset=Data(64),
        eval_dataset=Data(8),
        callbacks=[ProgressCallback()],
    )
    trainer.train()
    print(f"done {trainer.state.global_step}", flush=True)
    print("phases " + json.dumps(sorted(SEEN)), flush=True)
    if os.environ.get("PAGE_COPY"):  # the agent removes its private folder when it ends
        with open(os.environ["NODE_AGENT_PROGRESS_PAGE"], "rb") as src:
            page = src.read()
        with open(os.environ["PAGE_COPY"], "wb") as dst:
            dst.write(page)


if __name__ == "__main__":
    main()
