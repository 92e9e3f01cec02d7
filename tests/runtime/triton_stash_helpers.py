"""Helpers shared by the Triton stash tests (test_triton_stash.py: codecs; test_triton_stash_model.py: whole models,
launch counts, fake tensors, errors)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memopt.runtime import kernels, native, triton_fewbit
from memopt.stash import generic
from memopt.stash import stats as S


requires_triton = pytest.mark.skipif(not triton_fewbit.AVAILABLE, reason=f"triton does not import here "
                                                                         f"({triton_fewbit.IMPORT_ERROR})")
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def _run(choice, fn):
    """fn() with MEMOPT_KERNELS=choice (the C kernels off under triton: see the module docstring)."""
    torch.manual_seed(0)
    generic._GENERATORS.clear()  # stochastic rounding's private generator restarts at its seed
    with kernels.forced(choice), (native.disabled() if choice == "triton" else _nothing()):
        return fn()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _same(a, b, what=""):
    """Equal bit for bit (NaN payloads aside), same dtype, shape and strides; tuples, lists and None too."""
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
        return
    if a is None or not isinstance(a, torch.Tensor):
        assert a == b, what
        return
    assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride()), what
    if not a.is_floating_point():
        assert torch.equal(a, b), what
        return
    assert torch.equal(a.isnan(), b.isnan()), what
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    keep = ~a.isnan()
    assert torch.equal(a[keep].view(ints), b[keep].view(ints)), what


def _both(fn):
    plain, fused = _run("torch", fn), _run("triton", fn)
    return plain, fused


def _chain_input(shape, dtype, layout, seed=0, special=True):
    torch.manual_seed(seed)
    x = (torch.randn(shape) * 2 + 0.3)
    if special and x.numel() > 8:
        x.view(-1)[3] = 40.0  # far past the window: clipped, and where K reaches out, followed
        x.view(-1)[5] = -0.0
    x = x.to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


def _stats(x, affine_dtype=torch.float32):
    c = x.shape[1]
    torch.manual_seed(1)
    weight = (torch.rand(c) + 0.5).to(device=x.device, dtype=affine_dtype)
    bias = (torch.randn(c) * 0.5).to(device=x.device, dtype=affine_dtype)
    out, mean, invstd, _, _ = S.batch_norm_train(x, weight, bias, None, None, None, 0.1, 1e-5)
    return weight, bias, mean, invstd, out


class _Net(nn.Module):
    """conv-BN-ReLU-max-pool stem, a residual block with a downsample-free skip, dropout and a linear head."""

    def __init__(self, c=8):
        super().__init__()
        self.conv0, self.bn0 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv3, self.bn3 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.drop, self.fc = nn.Dropout(0.2), nn.Linear(c, 5)

    def forward(self, x):
        x = self.pool(F.relu(self.bn0(self.conv0(x))))
        y = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + x)
        y = F.relu(self.bn3(self.conv3(y)))
        return self.fc(self.drop(y.mean((2, 3))))
