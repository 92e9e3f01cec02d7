"""memopt.optim.Shampoo under misuse: non-finite gradients, bad or changed param groups, and
checkpoints saved before an option existed."""
import io
import re
import warnings

import pytest
import torch
from torch import nn

from memopt.optim import Shampoo

pytestmark = pytest.mark.usefixtures("one_thread")


def _grad(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _snapshot(opt, p):
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}


def _same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key], key


def _finite_state(opt, p):
    return all(torch.isfinite(v.float()).all() for v in opt.state[p].values() if torch.is_tensor(v))


# --- non-finite gradients -----------------------------------------------------------------------

NONFINITE = re.escape("Shampoo: parameter param_groups[0]['params'][0] (shape (70, 66)) has a non-finite "
                      "gradient (1 of 4620 elements NaN or inf); its step was skipped and its state left "
                      "unchanged.")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("kw", [{"bits": 4}, {"bits": 32}, {"bits": 4, "quantize": "statistics"},
                                {"bits": 4, "graft": "sgd", "lr": 0.05}])
def test_nonfinite_gradient_at_a_statistics_and_root_step_is_skipped(bad, kw):
    # stat_every=root_every=2: step 2 (the bad one) is a statistics and a root step
    w, b = nn.Parameter(torch.ones(70, 66)), nn.Parameter(torch.ones(66, 70))
    opt = Shampoo([w, b], stat_every=2, root_every=2, **kw)
    w.grad, b.grad = _grad((70, 66), 0), _grad((66, 70), 1)
    opt.step()
    before, w_before, b_before = _snapshot(opt, w), w.detach().clone(), b.detach().clone()
    w.grad = _grad((70, 66), 2)
    w.grad[3, 5] = bad
    b.grad = _grad((66, 70), 3)
    with pytest.warns(RuntimeWarning, match=NONFINITE):
        opt.step()
    _same_state(before, _snapshot(opt, w))  # step count included: the schedule counts finite steps
    assert torch.equal(w, w_before) and opt.state[w]["step"] == 1
    assert not torch.equal(b, b_before) and opt.state[b]["step"] == 2  # the other parameter stepped
    # a finite gradient afterwards takes the statistics/root step the bad one missed
    w.grad = _grad((70, 66), 4)
    opt.step()
    assert opt.state[w]["step"] == 2 and _finite_state(opt, w) and torch.isfinite(w).all()
    key = "pre.0.L.vals" if kw.get("quantize") != "statistics" else "pre.0.L.stat.diag"
    assert not torch.equal(opt.state[w][key], before[key])


def test_nonfinite_warning_names_the_parameter_once():
    model = nn.Sequential(nn.Linear(20, 80), nn.Tanh(), nn.Linear(80, 3))
    opt = Shampoo(model.named_parameters(), stat_every=1, root_every=1)
    x = torch.randn(16, 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            opt.zero_grad()
            model(x).sum().backward()
            if step in (1, 2):
                model[2].weight.grad[0, 0] = float("nan")
            opt.step()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and messages[0].startswith(
        "Shampoo: parameter '2.weight' (shape (3, 80)) has a non-finite gradient (1 of 240 elements")
    assert opt.state[model[2].weight]["step"] == 2 and opt.state[model[0].weight]["step"] == 4
    assert all(_finite_state(opt, p) and torch.isfinite(p).all() for p in model.parameters())


def test_nonfinite_gradient_before_any_state_leaves_no_state():
    p = nn.Parameter(torch.ones(8, 8))
    opt = Shampoo([p])
    p.grad = torch.full((8, 8), float("nan"))
    with pytest.warns(RuntimeWarning, match=r"\(64 of 64 elements NaN or inf\)"):
        opt.step()
    assert not opt.state[p] and torch.equal(p, torch.ones(8, 8))


# --- param groups -------------------------------------------------------------------------------

def test_bad_param_group_is_never_added_and_the_optimizer_stays_usable():
    p, q = nn.Parameter(torch.ones(70, 66)), nn.Parameter(torch.ones(5, 5))
    opt = Shampoo([p])
    for bad, message in ((dict(bits=2), r"bits=2 is not supported; use 4, 8 or 32"),
                         (dict(schedule="later"), r"schedule='later' is not known; use 'reference'"),
                         (dict(qr_iters=0), r"qr_iters=0 must be an int >= 1"),
                         (dict(eigh_every=-1), r"eigh_every=-1 must be an int >= 0")):
        with pytest.raises(ValueError, match=message):
            opt.add_param_group(dict(params=[q], **bad))
        assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [q], "lr": 0.1})  # q was not half-added: adding it again works
    p.grad, q.grad = _grad((70, 66), 0), _grad((5, 5), 1)
    opt.step()
    assert opt.state[p]["step"] == opt.state[q]["step"] == 1


@pytest.mark.parametrize("key, old, new", [
    ("bits", 4, 32), ("bits", 32, 8), ("quantize", "eigenvectors", "statistics"), ("graft", "adamw", "sgd"),
    ("block_size", 64, 32), ("quant_map", "linear2", "dynamic"), ("max_order", 1200, 32),
    ("min_quant_numel", 4096, 0)])
def test_changing_a_layout_hyperparameter_after_state_exists_names_it(key, old, new):
    w, v = nn.Parameter(torch.ones(70, 66)), nn.Parameter(torch.ones(10, 10))
    opt = Shampoo([{"params": [v]}, {"params": [w], key: old}], stat_every=1, root_every=1)
    w.grad, v.grad = _grad((70, 66), 0), _grad((10, 10), 1)
    opt.step()
    before, w_before, v_before = _snapshot(opt, w), w.detach().clone(), v.detach().clone()
    opt.param_groups[1][key] = new
    message = (f"param_groups[1]['{key}'] changed from {old!r} to {new!r} after its parameters' state was "
               f"built with {key}={old!r}; {key} decides how that state is stored, so it cannot change "
               f"mid-run. Set it back to {old!r}, or drop the state of those parameters (del "
               f"optimizer.state[p]) or create a new Shampoo to start over with {key}={new!r}")
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.step()
    # nothing moved, in either group: the check runs before any parameter steps
    assert torch.equal(w, w_before) and torch.equal(v, v_before)
    _same_state(before, _snapshot(opt, w))
    opt.param_groups[1][key] = old  # the fix the message names works
    opt.step()
    assert opt.state[w]["step"] == 2
    del opt.state[w]  # and so does the other one
    opt.param_groups[1][key] = new
    opt.step()
    assert opt.state[w]["step"] == 1 and opt.state[w]["layout"][key] == new


def test_hyperparameters_that_do_not_shape_state_may_change():
    w = nn.Parameter(torch.ones(70, 66))
    opt = Shampoo([w], bits=32, stat_every=1, root_every=1)
    w.grad = _grad((70, 66), 0)
    opt.step()
    opt.param_groups[0].update(lr=0.5, eps=1e-4, stat_every=3, schedule="eager", qr_iters=2,
                               block_size=32, quant_map="dynamic")  # quantization settings: unused at 32 bits
    opt.step()
    assert opt.state[w]["step"] == 2


def test_checkpoint_without_the_new_options_resumes_on_the_eager_schedule():
    w = nn.Parameter(torch.ones(70, 66))
    opt = Shampoo([w], stat_every=2, root_every=3, schedule="eager")
    w.grad = _grad((70, 66), 0)
    opt.step()
    saved = opt.state_dict()
    for group in saved["param_groups"]:  # as written before schedule / qr_iters / eigh_every existed
        for key in ("schedule", "qr_iters", "eigh_every", "tensor_layout", "vector_bits"):
            del group[key]
    del saved["state"][0]["layout"]
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    opt2 = Shampoo([w], stat_every=2, root_every=3)  # the default schedule is "reference" ...
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    group = opt2.param_groups[0]
    assert (group["schedule"], group["qr_iters"], group["eigh_every"]) == ("eager", 1, 0)  # ... but not here
    opt2.step()
    assert opt2.state[w]["layout"] == {"bits": 4, "vector_bits": None, "quantize": "eigenvectors", "graft": "adamw",
                                       "max_order": 1200, "tensor_layout": "matrix", "block_size": 64,
                                       "quant_map": "linear2", "min_quant_numel": 4096}


def test_layout_record_survives_save_and_load():
    w = nn.Parameter(torch.ones(70, 66))
    opt = Shampoo([w], graft="sgd", lr=0.05)
    w.grad = _grad((70, 66), 0)
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt2 = Shampoo([w], graft="sgd", lr=0.05)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert opt2.state[w]["layout"] == opt.state[w]["layout"] and opt2.state[w]["layout"]["graft"] == "sgd"
    opt2.step()
