import importlib.util

import pytest
import torch

from memopt.testing.zoo import ZOO

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def zoo_params(names=None):
    """pytest params over the zoo, skipping torchvision models when it is missing."""
    out = []
    for name in names or ZOO:
        marks = []
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
