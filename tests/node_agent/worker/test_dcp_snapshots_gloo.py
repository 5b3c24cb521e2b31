"""dcp_snapshots with two real gloo ranks on the CPU (FSDP2 and DTensor state saved and loaded
bit-identical, a rank with nothing to restore, a snapshot past its limit, a damaged file, another
world size), and its import cost. The format's checks are in test_dcp_snapshots.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from node_agent.worker import dcp_snapshots as D
from node_agent.worker import snapshots as S

from .test_dcp_snapshots import _VARS, ROOT

torch = pytest.importorskip("torch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fsdp_model(mesh: Any, seed: int) -> tuple[Any, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def two_ranks(rank: int, port: int, root: str) -> None:
    """One rank of the two: save, load into fresh state, and the refusals, in one process group."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

    for var in _VARS:
        os.environ.pop(var, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ[S.DIR_VAR] = os.path.join(root, f"r{rank}")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    try:
        mesh = DeviceMesh("cpu", [0, 1])
        model, opt = fsdp_model(mesh, seed=0)
        torch.manual_seed(1)
        for _ in range(2):
            model(torch.randn(4, 8)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

        def by_hand(fill: bool) -> dict[str, Any]:
            full = {
                "rows": torch.arange(24, dtype=torch.float32).view(6, 4),
                "uneven": torch.arange(3).to(torch.bfloat16),  # 2 + 1 elements
                "one": torch.tensor([5]),  # 1 + 0 elements: rank 1's shard is empty
            }
            out = {
                k: distribute_tensor(v if fill else torch.zeros_like(v), mesh, [Shard(0)])
                for k, v in full.items()
            }
            rep = torch.arange(6, dtype=torch.float64) if fill else torch.zeros(6, dtype=torch.float64)
            out["rep"] = distribute_tensor(rep, mesh, [Replicate()])  # every rank keeps its own copy
            return out

        msd, osd = get_state_dict(model, opt)
        sd = {
            "model": msd,
            "optim": osd,
            "dt": by_hand(True),
            "mine": torch.full((3,), float(rank)),
            "epoch": 7,
        }

        assert D.load(sd) is None  # nothing to restore yet, on every rank
        assert sd["epoch"] == 7

        D.save(3, sd)
        assert os.listdir(os.environ[S.DIR_VAR]) == [S.step_name(3)]

        model2, opt2 = fsdp_model(mesh, seed=1)
        msd2, osd2 = get_state_dict(model2, opt2)  # the optimizer's state made, zeroed
        sd2 = {"model": msd2, "optim": osd2, "dt": by_hand(False), "mine": torch.zeros(3), "epoch": 0}
        assert not all(
            torch.equal(local(a), local(b)) for a, b in zip(msd.values(), msd2.values(), strict=True)
        )
        os.environ[S.RESTORE_VAR] = "3"
        assert D.load(sd2) == 3
        set_state_dict(model2, opt2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])

        for p, q in zip(model.parameters(), model2.parameters(), strict=True):
            assert torch.equal(local(p), local(q))
            st, st2 = opt.state[p], opt2.state[q]
            assert st.keys() == st2.keys() == {"step", "exp_avg", "exp_avg_sq"}
            for k in st:
                assert torch.equal(local(st[k]), local(st2[k])), k
        for k, v in sd["dt"].items():
            assert v.placements == sd2["dt"][k].placements and torch.equal(
                v.to_local(), sd2["dt"][k].to_local()
            )
            assert v.to_local().dtype == sd2["dt"][k].to_local().dtype
        assert torch.equal(sd2["mine"], torch.full((3,), float(rank)))  # each rank's own copy
        assert sd2["epoch"] == 7

        # A snapshot outgrowing rank 1's limit: both ranks raise (rank 1 its own error), no file.
        if rank == 1:
            os.environ[S.LIMIT_VAR] = "2000"
        try:
            D.save(4, sd)
        except (S.SnapshotTooLarge, BaseException) as exc:
            assert isinstance(exc, S.SnapshotTooLarge) == (rank == 1), repr(exc)
        else:
            raise AssertionError("a snapshot past the limit was saved")
        os.environ.pop(S.LIMIT_VAR, None)
        assert os.listdir(os.environ[S.DIR_VAR]) == [S.step_name(3)]

        # One rank with nothing to restore: both refuse, neither hangs.
        if rank == 1:
            del os.environ[S.RESTORE_VAR]
        try:
            D.load(sd2)
        except D.RestoreFailed as exc:
            assert "ranks 0 restore step 3 and ranks 1 have nothing to restore" in str(exc), exc
        else:
            raise AssertionError("a rank loaded while another had nothing to restore")

        # A truncated file on rank 1: rank 1 says what is wrong with it, rank 0 that rank 1 failed.
        os.environ[S.RESTORE_VAR] = "3"
        path = os.path.join(os.environ[S.DIR_VAR], S.step_name(3))
        whole = open(path, "rb").read()
        if rank == 1:
            with open(path, "wb") as f:
                f.write(whole[:-10])
        try:
            D.load(sd2)
        except (D.SnapshotFormatError, D.RestoreFailed) as exc:
            expected = D.SnapshotFormatError if rank == 1 else D.RestoreFailed
            assert type(exc) is expected and "truncated" in str(exc), exc
            assert rank == 1 or "rank 1 cannot restore" in str(exc), exc
        else:
            raise AssertionError("a truncated file was loaded")
        with open(path, "wb") as f:
            f.write(whole)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., None], args: tuple[Any, ...], timeout: float = 90.0) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            assert time.monotonic() < deadline, "the two ranks did not finish in time"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(10)


@pytest.mark.timeout(120)
def test_two_gloo_ranks_save_and_load_fsdp2_and_dtensor_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for r in (0, 1):
        (tmp_path / f"r{r}").mkdir()
    spawn(two_ranks, (free_port(), str(tmp_path)))
    for r in (0, 1):
        assert [p.name for p in (tmp_path / f"r{r}").iterdir()] == [S.step_name(3)]
        p = D.parse(str(tmp_path / f"r{r}" / S.step_name(3)))
        assert (p.step, p.rank, p.world_size) == (3, r, 2)
    # Rank 0's real file, in a world of one (this process, no process group).
    for var in _VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(S.DIR_VAR, str(tmp_path / "r0"))
    monkeypatch.setenv(S.RESTORE_VAR, "3")
    with pytest.raises(D.WorldSizeMismatch, match="a world of 2 ranks and this world has 1"):
        D.load({})


def test_importing_the_module_does_not_import_torch() -> None:
    probe = (
        "import sys; from node_agent.worker import dcp_snapshots; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'numpy', 'asyncio'}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in _VARS}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
