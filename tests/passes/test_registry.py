"""One registry: Config's technique fields, the pass manager's order and the planner's hooks all come from
memopt.techniques.TECHNIQUES and the handlers registered against it."""
import dataclasses

import pytest

import memopt
from memopt.passes.base import registered_pass
from memopt.passes.manager import passes_for
from memopt.techniques import TECHNIQUES


def test_every_technique_has_a_config_field_a_pass_and_planner_hooks_in_registry_order():
    fields = [f.name for f in dataclasses.fields(memopt.Config) if f.name in {t.name for t in TECHNIQUES}]
    assert fields == [t.name for t in TECHNIQUES]
    for technique in TECHNIQUES:
        handler = registered_pass(technique.config_type)
        assert handler is not None and handler.name == technique.name
        assert handler.planner is not None, f"{technique.name} has no planner hooks"
        assert isinstance(getattr(memopt.Config(), technique.name), technique.config_type)
    assert [name for name, _, _ in passes_for(memopt.Config())] == [t.name for t in TECHNIQUES]


def test_a_config_type_outside_the_registry_must_name_its_pass():
    from memopt.passes.base import register_pass

    @dataclasses.dataclass(frozen=True)
    class Unregistered:
        pass

    with pytest.raises(ValueError, match=r"Unregistered is not a technique of memopt.techniques.TECHNIQUES: pass "
                                         r"name= to register_pass"):
        register_pass(Unregistered)(lambda gm, cfg, ctx: None)


def test_the_planner_and_the_gate_read_technique_facts_from_the_registry(monkeypatch):
    """No side tables: the time proxy and the gate's bit levels follow a technique's registered PlannerHooks."""
    from memopt.fidelity.repair import _levels
    from memopt.passes.base import _HANDLERS, planner_hooks
    from memopt.passes.planning import candidates
    from memopt.fewbit.config import FewBitConfig

    assert _levels(memopt.Config(), "fewbit") == tuple(sorted(memopt.Config().fewbit.plan_bits))
    assert _levels(memopt.Config(), "recompute") == ()  # exact only
    handler = _HANDLERS[FewBitConfig]
    hooks = dataclasses.replace(handler.planner, extra_passes=7.0, levels=lambda cfg: (2, None, 5))
    monkeypatch.setitem(_HANDLERS, FewBitConfig, dataclasses.replace(handler, planner=hooks))
    assert planner_hooks("fewbit") is hooks
    assert _levels(memopt.Config(), "fewbit") == (2, 5)

    class Baseline:
        nodes = {}

    monkeypatch.setattr(candidates, "node_numel", lambda baseline, unit: 10)
    assert candidates._time("fewbit", "relu", {"relu"}, Baseline()) == 70.0
