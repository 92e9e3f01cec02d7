import importlib.util
import os

import pytest
import torch

from memopt.core.heap import settled_resident_bytes as REAL_SETTLED
from memopt.testing.zoo import ZOO

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def pytest_configure(config):
    # pytest-xdist runs one worker process per core (pyproject's -n auto): one torch thread each, or the workers'
    # OpenMP pools oversubscribe the cores and spin (a test of 4 s alone took 144 s with 2 workers of 2 threads)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


# real-size zoo models (torchvision's, and a 20-layer ResNet): most of a zoo-wide test's time, so the fast tier
# (`pytest -q`) runs the small models and the slow tier (`pytest -q -m slow`) these
HEAVY = ("preact_resnet20", "resnet18", "resnet50", "mobilenet_v2", "vgg11_bn", "densenet121")


def zoo_params(names=None):
    """pytest params over the zoo, skipping torchvision models when it is missing; ``HEAVY`` ones are slow."""
    out = []
    for name in names or ZOO:
        marks = [pytest.mark.slow] if name in HEAVY else []
        if ZOO[name].needs_torchvision and not HAS_TORCHVISION:
            marks.append(pytest.mark.skip(reason="torchvision is not installed"))
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def call(model, inputs):
    """Call a model on example inputs given as a tensor, a tuple or a dict."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def leaves(output):
    return [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def one_thread():
    """One intra-op thread for tests of many tiny ops: on a loaded 2-core machine two threads made
    small LAPACK calls ~100x and tiny training steps ~30x slower (measured), and noisier."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_step_as_eager(om, model, reference, x):
    """One training step of ``om`` (optimizing ``model``) and of ``reference`` (its eager deep copy): outputs and
    every parameter's gradient bit-identical, and the bytes autograd keeps equal (memopt.measure)."""
    import memopt

    out, expected = om(x), reference(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
    assert memopt.measure(om, x).saved_bytes == memopt.measure(reference, x).saved_bytes



@pytest.fixture(scope="session", autouse=True)
def tensor_budgets():
    """Budgets in the suite are of the step's tensors: a CPU budget build's measured process growth
    (``memopt.core.heap.ResidentGrowth``) depends on which builds ran earlier in the worker (the first one leaves
    the math library's buffer pools), so it would make plans depend on test order. Session-wide, so module-scoped
    fixtures that plan see it too; tests of that measurement take the marker ``process_memory`` (below)."""
    import memopt.core.heap as heap

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(heap, "settled_resident_bytes", lambda: None)
        yield heap


@pytest.fixture(autouse=True)
def process_memory(request, monkeypatch, tensor_budgets):
    """The real process-memory reading for tests marked ``process_memory``."""
    if request.node.get_closest_marker("process_memory") is not None:
        monkeypatch.setattr(tensor_budgets, "settled_resident_bytes", REAL_SETTLED)
    yield
