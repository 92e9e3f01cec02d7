"""A rewritten training step never makes a CUDA host wait (issue 41): no op in memopt's forward or backward reads a
value back, has a data-dependent output shape, or copies between host and device (``memopt.testing.sync``).

Run on CPU tensors standing in for CUDA ones, on the two paths a CUDA step takes: plain PyTorch
(``MEMOPT_KERNELS=torch``, what CUDA runs without Triton or where a kernel family failed its first-use check) and
the Triton kernels (interpreted; a launch queues and returns on a GPU, so the interpreter's own host work is not
watched). The step measured is the second: the first makes the per-device constants and, by default on CUDA, runs
the kernels' first-use checks, once per process.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.runtime import kernels, native, triton_fewbit
from memopt.testing.sync import no_host_sync, report, unwatched

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# branches a CPU tensor takes and a CUDA one does not: (file, function) of the frame, and why it is not a CUDA sync
CPU_ONLY = {("stats.py", "xhat_std"): "reduces only where needed on the CPU; `x.device.type != 'cpu'` runs the "
                                     "reduction on CUDA without reading anything back"}


class CNN(nn.Module):
    """conv-BN-ReLU-max-pool stem, a residual BN-ReLU block, a linear head."""

    def __init__(self, c=8):
        super().__init__()
        self.conv0, self.bn0 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, 5)

    def forward(self, x):
        x = self.pool(F.relu(self.bn0(self.conv0(x))))
        y = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + x)
        return self.fc(y.mean((2, 3)))


class MLP(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.fc3(self.drop(F.gelu(self.fc2(self.drop(F.gelu(self.fc1(x)))))))


MODELS = {"cnn": (CNN, (4, 3, 16, 16)), "mlp": (MLP, (16, 32))}

def _cuda_syncs(found):
    return [s for s in found if not any(s.where.split(" in ")[-1] == fn and f"/{file}:" in s.where
                                        for file, fn in CPU_ONLY)]


@pytest.fixture
def triton_path(monkeypatch):
    if not triton_fewbit.AVAILABLE:
        pytest.skip(f"triton does not import here ({triton_fewbit.IMPORT_ERROR})")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real, launched = triton_fewbit._launch, set()

    def launch(kernel, *args, **meta):
        launched.add(kernel.__name__)
        with unwatched():
            return real(kernel, *args, **meta)

    monkeypatch.setattr(triton_fewbit, "_launch", launch)
    with kernels.forced("triton"), native.disabled():  # the C kernels, which run first on CPU tensors, out: as on CUDA
        yield launched


def _step_syncs(name):
    model_type, shape = MODELS[name]
    torch.manual_seed(0)
    model, x = model_type().train(), torch.randn(shape)
    om = memopt.optimize(copy.deepcopy(model), example_inputs=x)
    assert any(n.technique != "exact" for n in om.plan.nodes)
    om(x).square().mean().backward()  # the first step: one-time work
    with no_host_sync(strict=False) as found:
        om(x).square().mean().backward()
    return _cuda_syncs(found)


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_a_plain_path_step_never_syncs(one_thread, name):
    with kernels.forced("torch"):
        found = _step_syncs(name)
    assert not found, report(found)


@pytest.mark.parametrize("name, kernels_run", [("cnn", {"_chain_encode", "_bn_sums", "_walk_pack"}),
                                               ("mlp", {"_encode_pack", "_unpack_scale", "_group_encode"})])
def test_a_triton_path_step_never_syncs(one_thread, triton_path, name, kernels_run):
    found = _step_syncs(name)
    assert not found, report(found)
    assert kernels_run <= triton_path


def test_the_helper_sees_each_kind_of_sync():
    x = torch.randn(6)
    with no_host_sync(strict=False) as found:
        x[0].item(), x.tolist(), x.nonzero(), x[x > 0], torch.unique(x), x.cpu()
        torch.tensor([1.0], device=x.device)
        x * 2, x.sum(), x[torch.tensor([0, 2])], torch.where(x > 0, x, 0)  # none of these
    assert [s.op for s in found] == ["aten._local_scalar_dense.default", "Tensor.tolist", "aten.nonzero.default",
                                     "aten.index.Tensor", "aten._unique2.default", "Tensor.cpu", "torch.tensor"]
    assert found[0].where.endswith("in test_the_helper_sees_each_kind_of_sync")
    with pytest.raises(AssertionError, match=r"1 op\(s\) that would synchronise a CUDA host ran:\n- aten.nonzero"
                                             r".default at .*test_no_sync.py:\d+ in .*: its output shape depends on "
                                             r"the values \(1x\)"):
        with no_host_sync():
            x.nonzero()
    with no_host_sync(), unwatched():
        x.nonzero()  # not recorded
