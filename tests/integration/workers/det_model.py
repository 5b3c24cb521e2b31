"""The deterministic model of the snapshot and in-place workers (``snapshot_train.py``,
``inplace_train.py``): SGD with momentum, dropout, data from torch's generator, gradients
averaged with gloo. The state after step n depends only on n and the restored snapshot."""

import torch
import torch.distributed as dist


def model_and_optimizer(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 16)
    y = x.sum(dim=1, keepdim=True) / 4
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
