"""``torch.compile`` over an optimized module: dynamo traces memopt's autograd Functions. With the
``aot_eager`` backend the forward is bit-identical and a training step runs. (Inductor also runs;
its fused kernels round differently, as they do for a stock model: 4e-7 measured on TinyResNet.)"""
import copy

import torch

import memopt
from memopt.testing.zoo import build


def test_compiled_optimized_module_trains():
    model, x = build("tiny_resnet")
    reference = copy.deepcopy(model)
    om = memopt.optimize(model, example_inputs=x)
    compiled = torch.compile(om, backend="aot_eager")
    torch.manual_seed(0)
    out = compiled(x)
    torch.manual_seed(0)
    ref = reference(x)
    assert torch.equal(out, ref)
    out.logsumexp(1).mean().backward()
    ref.logsumexp(1).mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.isfinite(p.grad).all()
        assert torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0) > 0.95
