"""The soundness check and the fidelity gate capture the model on the same slice of the example inputs once
(memopt.builder.pipeline.handed_on): an export graph is captured on the slice once, not once each."""
from __future__ import annotations

import torch

import memopt
from memopt.builder.pipeline import handed_on
from memopt.capture import trace
from memopt.testing.zoo import ShapeBranch


def test_a_capture_goes_once_to_the_next_call_with_equal_inputs():
    made = []

    def recapture(args, kwargs):
        made.append(object())
        return made[-1]

    run = handed_on(recapture)
    x = torch.randn(4, 16)
    first = run((x,), {"k": 2})
    assert run((x.clone(),), {"k": 2}) is first and len(made) == 1  # equal inputs, each cut anew: handed on
    assert run((x.clone(),), {"k": 2}) is not first and len(made) == 2  # once only: the gate writes into it
    for other in [((x + 1,), {"k": 2}), ((x[:2],), {"k": 2}), ((x.double(),), {"k": 2}), ((x,), {"k": 3}),
                  ((x.clone().requires_grad_(),), {"k": 2}), ((x, x), {"k": 2})]:
        run((x,), {"k": 2})
        count = len(made)
        assert run(*other) is made[-1] and len(made) == count + 1, other  # not equal: captured again
    nan = torch.full((2,), float("nan"))
    run((nan,), {})
    assert run((nan.clone(),), {}) is made[-1] and len(made) == count + 3  # NaN != NaN: captured again, not shared


def test_an_export_graph_is_captured_on_the_slice_once(monkeypatch):
    exports = []
    export = trace.export_module
    monkeypatch.setattr(trace, "export_module", lambda *a, **k: exports.append(a[1][0].shape) or export(*a, **k))
    torch.manual_seed(0)
    model, x = ShapeBranch().train(), torch.randn(16, 16)  # symbolic_trace fails on the shape's branch
    reference = ShapeBranch().train()
    reference.load_state_dict(model.state_dict())
    om = memopt.optimize(model, example_inputs=x)
    assert om.plan.soundness["checked"] and om.plan.fidelity["passed"], om.report()
    # the whole batch, then the slice the soundness check and the gate share (not a second export of it)
    assert [tuple(s) for s in exports] == [(16, 16), (4, 16)], exports
    torch.manual_seed(1)
    out = om(x)
    torch.manual_seed(1)
    assert torch.equal(out, reference(x))
