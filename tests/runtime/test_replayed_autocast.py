"""``replayed_autocast``: backward recomputes under the forward's autocast state, and keeps nothing in autocast's
cache. Inside a user's autocast region (a backward run inside it) a nested region leaves its casts in the cache until
the outermost region exits, and the cache keeps a float32 leaf's cast, whose graph holds the leaf: every input a
backward rebuilt (a leaf that requires grad) would stay alive to the end of the backward (a 4-layer HF Llama under
bf16: docs/results/peak/largest_batch_llama_bf16.md's reading)."""
import gc
import weakref

import torch
import torch.nn.functional as F

from memopt.runtime.autocast import autocast_state, replayed_autocast


def _rebuilt_leaf_survives(replay) -> bool:
    weight = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the user's region, around forward and backward
        state = autocast_state()
        leaf = torch.randn(8, 32).requires_grad_()  # as a backward rebuilds a coded input
        alive = weakref.ref(leaf)
        with replay(state):
            out = F.linear(leaf, weight)  # autocast casts the float32 leaf to bf16
        assert out.dtype == torch.bfloat16
        torch.autograd.grad(out.sum(), (leaf, weight))
        del leaf, out
        gc.collect()
        return alive() is not None


def test_a_rebuilt_input_dies_with_its_backward_inside_the_users_autocast():
    assert not _rebuilt_leaf_survives(replayed_autocast)


def test_a_plain_nested_autocast_keeps_it_so_the_test_can_fail():
    def plain(state):
        return torch.autocast("cpu", dtype=torch.bfloat16)

    assert _rebuilt_leaf_survives(plain)


def test_the_forwards_state_is_replayed_outside_any_region():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = autocast_state()
    assert not torch.is_autocast_enabled("cpu")
    with replayed_autocast(state):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert F.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
