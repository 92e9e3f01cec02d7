"""``memopt.optimize(..., loss_fn=)``: the loss that trains is in every estimate of the build and among the fidelity
gate's losses; a loss the gate cannot run, or a loss_fn without example inputs, is refused with the fix."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt

VOCAB = 512


class TinyLM(nn.Module):
    """A language-model head: its cross-entropy over the vocabulary is the step's largest temporary, which the
    default loss (the sum of the outputs, whose gradient is an expanded scalar) does not allocate."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids):
        return self.head(self.mlp(self.emb(ids)))


TARGETS_BYTES = 8 * 32 * 8  # int64


def _case():
    torch.manual_seed(0)
    ids, targets = torch.randint(0, VOCAB, (8, 32)), torch.randint(0, VOCAB, (8, 32))
    return TinyLM(), ids, lambda out: F.cross_entropy(out.flatten(0, 1), targets[:len(out)].flatten())


def test_the_estimate_counts_the_given_loss_and_equals_the_measured_step():
    model, ids, loss_fn = _case()
    plain = memopt.optimize(model, example_inputs=ids, optimizer="adamw", config=memopt.Config.exact())
    with_loss = memopt.optimize(model, example_inputs=ids, optimizer="adamw", config=memopt.Config.exact(),
                                loss_fn=loss_fn)
    measured = memopt.measure(model, ids, loss_fn, optimizer="adamw")
    assert with_loss.plan.baseline_peak_bytes > plain.plan.baseline_peak_bytes  # the loss's logits-sized temporaries
    # the targets the loss closes over exist before the step; the real run's tracker first sees their storage in
    # the loss (a slice of it) and counts it, the fake run's does not: at most their bytes apart
    assert 0 <= measured.peak_bytes - with_loss.plan.baseline_peak_bytes <= TARGETS_BYTES
    assert with_loss.plan.estimated_peak_bytes == with_loss.plan.baseline_peak_bytes  # Config.exact()


def test_the_gate_checks_the_given_loss_too():
    model, ids, loss_fn = _case()
    om = memopt.optimize(model, example_inputs=ids, loss_fn=loss_fn)
    gate = om.plan.fidelity
    assert gate["user_loss"] and gate["projections"] >= 3  # a projection, loss_fn, the outputs' own direction
    assert "their own direction and loss_fn" in om.report()
    plain = memopt.optimize(model, example_inputs=ids)
    assert not plain.plan.fidelity["user_loss"] and "their own direction)" in plain.report()


def test_other_input_sizes_train_with_the_default_loss_estimate():
    model, ids, loss_fn = _case()
    om = memopt.optimize(model, example_inputs=ids, loss_fn=loss_fn)
    other = torch.randint(0, VOCAB, (4, 16))
    out = om(other)  # planned for a signature loss_fn (bound to the example batch's targets) was not given for
    F.cross_entropy(out.flatten(0, 1), torch.randint(0, VOCAB, (64,))).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_loss_the_gate_cannot_run_on_its_slice_is_refused_with_the_fix():
    model, ids, _ = _case()
    targets = torch.randint(0, VOCAB, (8, 32))
    with pytest.raises(memopt.MemoptError, match=r"loss_fn raised on the output of the fidelity gate's slice \(the "
                                                 r"first 4 of 8 samples\): ValueError: .*index the targets by the "
                                                 r"output's length"):
        memopt.optimize(model, example_inputs=ids,
                        loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten()))


def test_a_loss_that_is_not_a_scalar_is_refused():
    model, ids, _ = _case()
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor, got Tensor \(8, 32, 512\); reduce "
                                         r"it \(.mean\(\) or .sum\(\)\)"):
        memopt.optimize(model, example_inputs=ids, loss_fn=lambda out: out * 2)


def test_loss_fn_needs_example_inputs_and_a_callable():
    model, _, loss_fn = _case()
    with pytest.raises(ValueError, match="loss_fn is the loss of the example batch's output: give example_inputs="):
        memopt.optimize(model, loss_fn=loss_fn)
    with pytest.raises(TypeError, match="loss_fn must map the model's output to a scalar loss .* got str"):
        memopt.optimize(model, example_inputs=torch.zeros(2, 4, dtype=torch.long), loss_fn="cross_entropy")


class Checkpointed(nn.Module):
    """Blocks under torch.utils.checkpoint (as Hugging Face's gradient checkpointing runs them) and a head: captured
    per submodule, where loss_fn reaches the measured steps and the whole-model gate."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)) for _ in range(3))
        self.head = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 10))

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def test_a_model_captured_per_submodule_measures_and_gates_with_the_given_loss():
    torch.manual_seed(0)
    model, x, y = Checkpointed(), torch.randn(16, 32), torch.randint(0, 10, (16,))
    loss_fn = lambda out: F.cross_entropy(out, y[:len(out)])  # noqa: E731
    om = memopt.optimize(model, example_inputs=x, loss_fn=loss_fn)
    assert om.plan.capture == "per-submodule"
    assert om.plan.baseline_peak_bytes == memopt.measure(model, x, loss_fn).peak_bytes
    assert om.plan.fidelity["user_loss"] and "and loss_fn" in om.report()
