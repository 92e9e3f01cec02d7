"""Shampoo under DistributedDataParallel: gloo, 2 CPU processes, each rank with the full state."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from memopt.optim import Shampoo
from memopt.testing.distributed import free_port, spawn

STEPS = 4


def _initial_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 70), nn.Tanh(), nn.Linear(70, 66), nn.Tanh(), nn.Linear(66, 4))


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _initial_model()  # identical initial weights on every rank
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = Shampoo(ddp.parameters(), lr=0.01, stat_every=1, root_every=2)
        g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
        for _ in range(STEPS):
            x, y = torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        torch.save({"params": flat, "gathered": gathered, "state_keys": sorted(opt.state[model[2].weight])},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while the other still talks to it (SIGABRT seen)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_ranks_stay_identical(tmp_path):
    spawn(_worker, (2, free_port(), str(tmp_path)), timeout=120)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    initial = torch.cat([p.detach().reshape(-1) for p in _initial_model().parameters()])
    for res in results:
        assert torch.equal(res["gathered"][0], res["gathered"][1])  # identical updates on both ranks
        assert torch.isfinite(res["params"]).all() and not torch.equal(res["params"], initial)
        assert any(k.endswith(".codes") for k in res["state_keys"])  # the 70x70 / 66x66 state is 4-bit

