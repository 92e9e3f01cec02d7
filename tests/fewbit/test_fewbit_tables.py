"""Few-bit tables: global optimality on the grid, the uniform-weight identity, symmetry, weights, shipped data."""
import itertools
import json

import pytest
import torch

import memopt
from memopt.fewbit.activations import ACTIVATIONS, TABLE_ACTIVATIONS
from memopt.fewbit.tables import (SHIPPED, SHIPPED_WEIGHTS, _cell_integrals, _cached, compute_table, fewbit_table,
                                  shipped_key, table_error)


def test_one_bit_gelu_and_silu_are_the_relu_derivative():
    for name in ("gelu", "silu"):
        borders, levels = fewbit_table(name, 1)
        assert borders.dtype == levels.dtype == torch.float64
        assert borders.tolist() == [0.0]
        assert levels.tolist() == pytest.approx([0.0, 1.0], abs=0.06)


@pytest.mark.parametrize("name", ["gelu", "tanh", "softplus", "hardswish"])
def test_uniform_levels_are_secant_slopes(name):
    act = ACTIVATIONS[name]
    borders, levels = fewbit_table(name, 3)
    ends = torch.cat([torch.tensor([-10.0], dtype=torch.float64), borders, torch.tensor([10.0], dtype=torch.float64)])
    f = act(ends, act.params({}))
    torch.testing.assert_close(levels, (f[1:] - f[:-1]) / (ends[1:] - ends[:-1]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name, weight", [("gelu", "uniform"), ("sigmoid", "normal"), ("mish", "uniform")])
def test_dp_is_the_global_optimum_on_the_grid(name, weight):
    grid, bits = 24, 2
    params = ACTIVATIONS[name].params({})
    edges = torch.linspace(-4.0, 4.0, grid + 1, dtype=torch.float64)
    W, F1, F2 = _cell_integrals(name, params, edges, weight, 1.5)

    def error(cuts):  # brute force: every piece's weighted squared error around its weighted mean
        total = 0.0
        for a, b in zip(cuts[:-1], cuts[1:]):
            w, f1, f2 = W[a:b].sum(), F1[a:b].sum(), F2[a:b].sum()
            total += float(f2 - f1 * f1 / w)
        return total

    brute = min(error((0, *inner, grid)) for inner in itertools.combinations(range(1, grid), 2 ** bits - 1))
    _, _, dp = compute_table(name, bits, domain=(-4.0, 4.0), weight=weight, grid=grid, scale=1.5)
    assert dp == pytest.approx(brute, rel=1e-9, abs=1e-12)


def test_moving_a_border_never_helps():
    borders, levels = fewbit_table("silu", 3)
    best = table_error("silu", borders, levels)
    for i in range(borders.numel()):
        for step in (-0.05, 0.05):
            moved = borders.clone()
            moved[i] += step
            # refit the levels for the moved borders: the weighted mean (secant slope) on each piece
            act = ACTIVATIONS["silu"]
            ends = torch.cat([torch.tensor([-10.0], dtype=torch.float64), moved, torch.tensor([10.0], dtype=torch.float64)])
            f = act(ends, act.params({}))
            assert table_error("silu", moved, (f[1:] - f[:-1]) / (ends[1:] - ends[:-1])) >= best - 1e-12


@pytest.mark.parametrize("name", ["gelu", "silu"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_point_symmetric_derivatives_give_symmetric_tables(name, bits):
    borders, levels = fewbit_table(name, bits)
    torch.testing.assert_close(borders, -borders.flip(0), rtol=0, atol=1e-9)
    torch.testing.assert_close(levels, 1 - levels.flip(0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["tanh", "sigmoid"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_even_derivatives_have_mirror_image_optima(name, bits):
    borders, levels = fewbit_table(name, bits)
    mirrored_borders, mirrored_levels = -borders.flip(0), levels.flip(0)
    assert table_error(name, mirrored_borders, mirrored_levels) == pytest.approx(table_error(name, borders, levels),
                                                                                 rel=1e-6)


def test_weights_normal_callable_and_histogram():
    narrow, _ = fewbit_table("gelu", 3, weight="normal", scale=0.5)
    wide, _ = fewbit_table("gelu", 3)
    assert narrow.abs().max() < wide.abs().max()  # borders follow the weight
    same, _ = fewbit_table("gelu", 3, weight=lambda x: torch.exp(-0.5 * (x / 0.5) ** 2))
    torch.testing.assert_close(same, narrow)  # normalisation does not change the optimum
    samples = torch.randn(100_000, dtype=torch.float64) * 0.3 + 1.0
    counts, edges = torch.histogram(samples, bins=64)
    borders, levels = fewbit_table("gelu", 3, weight=(counts, edges))
    assert borders.numel() == 7 and levels.numel() == 8
    assert ((borders > edges[0]) & (borders < edges[-1])).all()  # all borders where the data is


@pytest.mark.parametrize("kwargs, message", [
    ({"weight": "cauchy"}, "weight='cauchy' is not known"),
    ({"bits": 0}, "bits must be an int in 1..8, got 0"),
    ({"bits": 9}, "bits must be an int in 1..8, got 9"),
    ({"domain": (2.0, 1.0)}, "low < high"),
    ({"weight": (torch.ones(3), torch.arange(3.0))}, "len(bin_edges) == len(counts) + 1"),
])
def test_bad_table_arguments(kwargs, message):
    args = {"bits": 3, **kwargs}
    with pytest.raises(ValueError) as info:
        fewbit_table("gelu", args.pop("bits"), **args)
    assert message in str(info.value)


def test_exact_ops_need_no_table_and_unknown_ops_are_named():
    with pytest.raises(ValueError, match="relu is piecewise linear"):
        fewbit_table("relu", 2)
    with pytest.raises(ValueError, match="does not support 'swish2'"):
        fewbit_table("swish2", 2)
    with pytest.raises(ValueError, match=r"elu has no hyper-parameters \['beta'\]"):
        fewbit_table("elu", 2, params={"beta": 1.0})


def test_non_default_hyper_parameters_get_their_own_tables():
    a, _ = fewbit_table("elu", 3)
    b, _ = fewbit_table("elu", 3, params={"alpha": 0.3})
    erf, _ = fewbit_table("gelu", 3)
    tanh, _ = fewbit_table("gelu", 3, params={"approximate": "tanh"})
    assert not torch.equal(a, b) and not torch.equal(erf, tanh)


@pytest.mark.slow
def test_shipped_tables_equal_a_fresh_computation():
    shipped = json.loads(SHIPPED.read_text())
    names = {key.split("|")[0] for key in shipped}
    assert names == set(TABLE_ACTIVATIONS)
    assert all(f"|{b}" in "".join(shipped) for b in range(1, 9))
    assert {key.split("|")[3] if key.count("|") == 3 else "uniform" for key in shipped} == set(SHIPPED_WEIGHTS)
    for key, entry in shipped.items():
        name, params_text, bits, *weight = key.split("|")
        weight = weight[0] if weight else "uniform"
        if int(bits) > 4:
            continue  # bits 5-8 take seconds each: tools/gen_fewbit_tables.py regenerates them
        params = tuple((k, v) for k, v in (p.split("=") for p in params_text.split(",") if p))
        params = ACTIVATIONS[name].params({k: (v if k == "approximate" else float(v)) for k, v in params})
        assert shipped_key(name, params, int(bits), weight) == key
        borders, levels, error = compute_table(name, int(bits), params=params, weight=weight)
        # The last bits of a fresh table follow the machine's libm (glibc picks its tanh / exp / log code by CPU
        # features): on an Intel Xeon with AVX-512 the tanhshrink levels differed from the shipped ones in the
        # 16th digit, the errors by up to 2.1e-12 relative, and where the derivative is even (tanh, tanhshrink)
        # the DP chose the mirror image of the shipped partition: an exact tie on the symmetric grid, which those
        # last bits break either way. Same partition or its mirror, same levels (mirrored), same error.
        fresh, ours = borders.tolist(), entry["borders"]
        mirrored = fresh != ours and fresh == [-b for b in reversed(ours)]
        assert fresh == ours or (mirrored and name in ("tanh", "tanhshrink")), key
        expected = list(reversed(entry["levels"])) if mirrored else entry["levels"]
        assert levels.tolist() == pytest.approx(expected, rel=1e-10), key
        assert error == pytest.approx(entry["error"], rel=1e-10)


def test_tables_are_cached():
    before = _cached.cache_info().hits
    fewbit_table("mish", 2, weight="normal", scale=2.0)
    fewbit_table("mish", 2, weight="normal", scale=2.0)
    assert _cached.cache_info().hits == before + 1
    assert memopt.fewbit_table is fewbit_table
