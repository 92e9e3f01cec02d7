"""Saved plans and configs carry a schema version; plan.json files written before it existed still load and
re-apply (the fixture was written by memopt at commit 6f17291, before the redesign)."""
import json
from pathlib import Path

import pytest
import torch

import memopt
from memopt.config import CONFIG_SCHEMA_VERSION
from memopt.record.plan import PLAN_SCHEMA_VERSION
from memopt.testing.zoo import build

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "plan_v1_tiny_resnet.json"


def test_a_plan_written_before_the_redesign_loads_and_reapplies_to_the_same_bytes():
    old = json.loads(FIXTURE.read_text())
    assert "schema_version" not in old  # written before the field existed
    plan = memopt.Plan.load(FIXTURE)
    assert plan.schema_version == 1 and plan.units and plan.chosen_units()
    torch.manual_seed(0)
    model, x = build("tiny_resnet")
    om = memopt.optimize(model, example_inputs=x, optimizer="sgd", plan=FIXTURE)
    om(x).sum().backward()
    assert om.plan.chosen_units() == plan.chosen_units()
    # the same bytes, but for one runtime change since: a chain joined by a downsample BatchNorm keeps that BN's x̂
    # std (4 bytes per channel), which cannot be recovered from invstd where var << eps (7ff9dec)
    joined = [n for n in om.plan.nodes if n.op == "bn_act_stash" and ": exact forward" in n.reason
              and " + BN " in n.reason]
    extra = sum(4 * int(n.shape.split("x")[1]) for n in joined)
    assert joined and extra > 0
    assert om.plan.estimated_saved_bytes == old["estimated_saved_bytes"] + extra
    assert om.plan.estimated_peak_bytes == old["estimated_peak_bytes"] + extra
    assert om.plan.schema_version == PLAN_SCHEMA_VERSION


def test_plan_and_config_round_trip_with_their_versions(tmp_path):
    model, x = build("tiny_resnet")
    om = memopt.optimize(model, example_inputs=x)
    om(x).sum().backward()
    om.plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["schema_version"] == PLAN_SCHEMA_VERSION
    assert data["config"]["schema_version"] == CONFIG_SCHEMA_VERSION
    assert memopt.Plan.load(tmp_path / "plan.json") == om.plan
    assert memopt.Config.from_dict(memopt.Config().to_dict()) == memopt.Config()


def test_bad_plan_files_name_the_file_and_the_problem(tmp_path):
    truncated = tmp_path / "truncated.json"
    truncated.write_text(FIXTURE.read_text()[:200])
    with pytest.raises(ValueError, match=r"truncated\.json is not valid JSON .* at line \d+"):
        memopt.Plan.load(truncated)
    future = tmp_path / "future.json"
    future.write_text(json.dumps({**json.loads(FIXTURE.read_text()), "schema_version": PLAN_SCHEMA_VERSION + 1}))
    with pytest.raises(ValueError, match=rf"future\.json has schema_version {PLAN_SCHEMA_VERSION + 1}; this memopt "
                                         rf"reads versions 1 to {PLAN_SCHEMA_VERSION}"):
        memopt.Plan.load(future)
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({**json.loads(FIXTURE.read_text()), "colour": "red"}))
    with pytest.raises(ValueError, match=r"odd\.json is not a memopt plan of schema 1: unknown keys \['colour'\]"):
        memopt.Plan.load(odd)
    with pytest.raises(ValueError, match=r"Config schema_version 99 is not one this memopt reads"):
        memopt.Config.from_dict({"schema_version": 99})
