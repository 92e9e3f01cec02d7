"""The fidelity gate: check a plan's gradients per parameter against exact autograd, and repair the plan.

The planner's fidelity proxies are models of the error; the gate measures it. On a slice of the example batch
(``soundness.batch_slice``, so the check fits where the plan does) it runs one training step of the eager model
(exact: the capture check showed the captured graph is bit-identical to it) and one of the graph rewritten by
the plan's decision, from the same state and RNG, and compares every parameter's gradient (cosine), under a
random projection of the outputs and, to confirm a passing plan, under the outputs' own direction (``OwnDirection``)
and further projections. Parameters whose exact gradient is tiny beside the median (``FidelityConfig.tiny``), ~0 by
construction (``invariant_params``), or not resolved by the model's own precision (float64's step against float32's,
``conditioning``; float32's against autocast's) are listed apart with the reason: their direction is rounding. For each parameter below ``min_cosine`` the lossy units nearest to it in the captured graph
(the nodes that use the parameter, then their neighbours, widening when the nearest are exact already) are
raised to their technique's next bit width, or made exact; the step is repeated until every parameter passes
or ``max_rounds`` is spent. The report records every change and the final per-parameter figures.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import fx, nn

from memopt.capture.trace import flat_inputs
from memopt.config import Config
from memopt.core.errors import MemoptError
from memopt.fidelity.conditioning import _misses, autocast_noise, float64_noise, gate_report, judged, \
    parameter_fidelity, per_min, worst_over
from memopt.fidelity.gate_slice import batch_size as _batch, gate_graph
from memopt.fidelity.invariant_params import invariant_parameters
from memopt.fidelity.references import on_host, worth_pairing
from memopt.fidelity.losses import OwnDirection, RandomProjection, UserLoss, gate_losses, \
    projection  # noqa: F401 (re-exported: tools and tests reach them as memopt.fidelity.gate.*)
from memopt.fidelity.repair import _fewest_exact, _key, _raise, _raise_all, _without, coupled, freed_by, \
    freed_table, shortest_passing  # noqa: F401 (re-exported: tests reach them as memopt.fidelity.gate.*)
from memopt.fidelity.scope import after, responsible, weight_only_units, within_reach
from memopt.passes.base import Decision, PassContext
from memopt.passes.planning.candidates import rewritten_units
from memopt.passes.planning.planner import apply_decision
from memopt.reversible.check import real_examples
from memopt.capture.soundness import paired_grads, training_grads

log = logging.getLogger("memopt")

# When more than this fraction of the gated parameters miss (and more than WIDESPREAD_LEAST of them), the error is
# the compounding of many lossy units along the whole backward (3-bit SiLU / hard-swish tables over 20-50 layers),
# not one unit's: the gate then raises every lossy unit of one technique a level at once, the technique whose
# raise helps most (one trial step each). Otherwise it raises the units nearest to each missing parameter.
WIDESPREAD = 0.05
# Losses a passing plan must pass (``projection``): the first drives the repair, the others confirm.
PROJECTIONS = 2
# A plan whose worst cosine passes by less than MARGIN is confirmed on further projections, up to
# MAX_PROJECTIONS: a small parameter's cosine spreads with the projection (a 16-element LayerNorm weight of a tiny
# Swin: 0.976 to 0.995 over 12 projections of one plan), so two draws near the bar say little about a third.
# Eight fresh projections found what four did not: timm MobileNetV3-Small-050 at 8x128 passed four at 0.9925 and
# gave 0.952 under a fifth; with MARGIN 0.01 and eight it is repaired (docs/results/fidelity/gate_miss.md).
# Nor do a parameter's first losses predict the rest: confirming only until each parameter's predicted 1% tail
# (tail.py's F ratio, the estimate's own spread from n losses included) clears the bar let timm MobileViTv2-050 at
# 8x128 pass on two losses and on four (stages.3.1.transformer.3.mlp.fc2.bias >= 0.9926 under them) and give 0.9677
# under a fresh projection; eight found it (worst unseen 0.9935): docs/results/archive/fidelity/
# gate_miss_settled_sample.md.
# MAX_PROJECTIONS is FidelityConfig.max_projections' default.
MARGIN = 0.01
MAX_PROJECTIONS = 8
# The last resort's plan is confirmed like any other (``confirm``) and resorted again at most this many times.
RESORT_CONFIRMS = 2
WIDESPREAD_LEAST = 3
# Rounds past EARLY_RESORT go on while they help: after STALL_ROUNDS rounds in a row that neither pass a parameter
# nor lift any failing parameter's cosine by STALL_GAIN above its best, the repair is stuck (the error comes from
# units the graph neighbourhood does not reach: MambaOut's depthwise conv bias stayed at 0.9887 over ten rounds)
# and the last resort runs, so a generous ``max_rounds`` costs time only where rounds make progress (MobileOne's
# cancelling BN weights pass in the seventh round, one BN branch per stage each round). Before EARLY_RESORT
# rounds the gate never stops early: a stall of three rounds can end in the next (torchvision MobileNetV2).
STALL_ROUNDS = 3
STALL_GAIN = 1e-3
# More rounds are not always better: each raises the units nearest the failing parameters, where the last resort
# finds the fewest units that pass by halving. Past EARLY_RESORT rounds the gate has both: the last resort applied
# there (on a copy) and the rounds' own end, and keeps whichever frees more by the planner's bytes (torchvision
# MobileNetV2 lost 10.2x -> 3.1x to six more rounds; timm MobileOne gained 1.3x -> 2.4x from one more).
EARLY_RESORT = 6
# The last resort halves over its candidates in the order of each one's measured effect (the failing parameters'
# cosines with that unit alone exact: one trial plan each) when there are at most MEASURED_ORDER of them, else by
# the error proxies. The proxies rank by a unit's own error, not by its reach: timm MambaOut's 3-bit head GELU,
# ranked low, alone fixed all four failing conv biases that 11-14 exact 8-bit units fixed in the proxy order.
MEASURED_ORDER = 48


def fidelity_gate(model: nn.Module, args: tuple, kwargs: dict, config: Config, decision: Decision,
                  units: List[Dict[str, Any]], planned: fx.GraphModule, verify_only: bool = False,
                  recapture: Optional[Callable[[tuple, dict], fx.GraphModule]] = None,
                  loss_fn: Optional[Callable[[Any], Any]] = None) -> Tuple[Decision, Dict[str, Any]]:
    """(the repaired decision, the report) for ``decision`` on ``model`` (``units``: ``Plan.units``; ``planned``:
    the annotated, not yet rewritten graph the plan was made on; ``verify_only``: measure, repair nothing;
    ``recapture(args, kwargs)``: the model captured on other inputs as ``planned`` was, see ``gate_graph``;
    ``loss_fn``: the user's loss, checked second, see ``UserLoss``)."""
    gate = config.fidelity
    start = time.perf_counter()
    base, sliced_args, sliced_kwargs, which = gate_graph(model, planned, args, kwargs, recapture)
    ctx = PassContext(sliced_args, sliced_kwargs, config.device, real_examples(flat_inputs(base, sliced_args,
                                                                                         sliced_kwargs)))
    names = [n for n, _ in model.named_parameters()]
    invariant = invariant_parameters(base, (_batch(sliced_args, sliced_kwargs) / _batch(args, kwargs)) if
                                     _batch(args, kwargs) else 1.0)  # the graph's shapes are the whole batch's
    rng = torch.Generator().manual_seed(0).get_state()  # a fixed draw (dropout): the same plan, the same report
    next_loss = gate_losses(loss_fn, which)
    least = PROJECTIONS + (loss_fn is not None)
    most = max(least, gate.max_projections + (loss_fn is not None))
    # confirmations make each loss's eager gradients beside the plan's (two forwards alive) where that keeps less
    fraction = _batch(sliced_args, sliced_kwargs) / _batch(args, kwargs) if _batch(args, kwargs) else 1.0
    pairing = [worth_pairing(model, base, most - least, fraction)]  # off at a first conflict
    drawn: Dict[int, Any] = {}  # each loss made once: its own random weights

    def loss_at(index: int) -> Any:
        if index not in drawn:
            drawn[index] = next_loss(index)
        return drawn[index]

    losses = [loss_at(0)]
    steps = [0]  # gradients computed (a backward each; ``training_grads`` shares one forward between losses)
    cache: Dict[tuple, List[Dict[str, Dict[str, Any]]]] = {}  # plan -> its figures under each projection
    ahead: Dict[tuple, Dict[int, Dict[str, Dict[str, Any]]]] = {}  # plan -> figures under losses not in use yet
    exact_ahead: Dict[int, List[Optional[torch.Tensor]]] = {}  # the eager step's gradients, loss by loss
    first = [True]

    unresolved: Set[int] = set()  # losses whose precision check has not run yet

    def resolve(index: int) -> None:
        """The parameters the eager step's precision does not resolve under loss ``index`` join those listed apart
        (under autocast against float32, else against float64: a small one is noisy under some projections only)."""
        unresolved.discard(index)
        loss, grads = losses[index], exact_grads(index)
        noisy = autocast_noise(model, sliced_args, sliced_kwargs, rng, loss, names, grads, gate.tiny,
                               gate.min_cosine)
        if noisy is None:
            noisy = float64_noise(model, sliced_args, sliced_kwargs, rng, loss, names, grads, gate.tiny,
                                  gate.min_cosine, parameter_fidelity)
        steps[0] += noisy is not None
        new = {p: why for p, why in (noisy or {}).items() if p not in invariant}
        invariant.update(new)
        exclude(new)

    def exclude(new: Dict[str, str]) -> None:
        """Plans measured before list ``new`` apart too (under the losses in use and those measured ahead)."""
        for figures in [f for done in cache.values() for f in done] + [f for a in ahead.values() for f in
                                                                       a.values()]:
            for p in new.keys() & figures.keys():
                figures[p]["excluded"] = True

    def exact_grads(index: int) -> List[Optional[torch.Tensor]]:
        """The eager step's gradients under loss ``index``, in batches from one forward: the first ``least``
        losses, then every one up to ``most`` (a plan that passes by less than MARGIN, as most do, is confirmed on
        all of them), kept in host memory (``on_host``) for every plan measured under them. Where the gate pairs
        (``paired``), only the first ``least`` are kept: a later loss's are made for the one use (a plan measures
        them beside its own, ``measure``), so the gate holds ``least`` copies of the gradients, not ``most``."""
        if index in exact_ahead:
            return exact_ahead[index]
        paired = pairing[0]
        batch = list(range(index, least if index < least else index + 1 if paired else most))
        found: List[List[Optional[torch.Tensor]]] = []
        training_grads(model, model, sliced_args, sliced_kwargs, rng, [loss_at(i) for i in batch],
                       stop=lambda grads: found.append(on_host(grads)) or False, keep=False)
        steps[0] += len(batch)
        if paired and index >= least:
            return found[0]
        exact_ahead.update(zip(batch, found))
        return exact_ahead[index]

    def exact_step(index: int) -> None:
        """Loss ``index`` joins those in use; its eager gradients (``exact_grads``) are made when a plan is measured
        under it or its precision check runs, unless a confirmation measured a plan beside them (``measure``'s
        pairs). Its precision check (``resolve``) runs at once for the first loss, so the report lists what float32
        does not resolve; for a later loss only once a parameter misses under it: it can only list parameters apart,
        and on most plans every parameter passes (a float64 step costs several float32 ones on CPU)."""
        unresolved.add(index)

    exact_step(0)
    resolve(0)
    # a joint option's parts share their group's nodes (coupled units are neighbours)
    parts = [(part, u["nodes"]) for u in units for part in (u["chosen"].get("parts") or [u["chosen"]]) if _lossy(part)]
    lossy_nodes = {(part["technique"], part["unit"]): set(nodes) for part, nodes in parts}
    weights = {(part["technique"], part["unit"]): float(part["fidelity"]) for part, _ in parts}
    couplings = sorted({tuple(c) for u in units for c in u.get("couplings", ())})
    only = weight_only_units(apply_decision(base, config, decision, ctx)[0])  # units that reach weights alone
    plain = _without(decision, [k for k in lossy_nodes if k[1] in decision.get(k[0], {})])  # every lossy unit exact

    def reach(lossy: Dict[Tuple[str, str], Set[str]], parameter: str) -> Dict[Tuple[str, str], Set[str]]:
        return within_reach(lossy, only, parameter)

    floored: Set[int] = set()  # losses whose rounding check (``floor``) has run

    def floor(indices: List[int]) -> None:
        """The parameters that miss under losses ``indices`` with every lossy unit exact join those listed apart:
        the rewritten graph's own rounding moves them that far (a near-invariant gradient, small beside the terms
        it sums, as a BatchNorm weight before ReLU, a depthwise conv and another BatchNorm), so no code is to blame
        and none can be repaired; float32 eager can resolve them by the luck of its order (``resolve`` lists only
        what it does not)."""
        figures = figures_of(plain, every=True)
        for index in indices:
            floored.add(index)
            new = {p: (f"with every lossy unit exact its gradient is at cosine {f['cosine']:.3f} to eager's: the "
                       f"rewritten graph's float32 rounding, not a code's error") for p, f in figures[index].items()
                   if judged(f) < gate.min_cosine and p not in invariant}
            invariant.update(new)
            exclude(new)
        tails = {p: (f"with every lossy unit exact the 1% tail its {f['tail']} losses predict is at cosine "
                     f"{f['cosine']:.3f} to eager's: the rewritten graph's float32 rounding, not a code's error")
                 for p, f in worst_over(figures).items() if f.get("tail") and judged(f) < gate.min_cosine and
                 p not in invariant}
        invariant.update(tails)
        exclude(tails)

    def evaluate(trial: Decision) -> Tuple[Dict[str, Dict[str, Any]], List[str]]:
        """(per-parameter fidelity, the failing parameters, worst first) of the plan ``trial`` (its couplings kept:
        what is measured is what could ship): per parameter the worst over the projections in use (each trial's
        step under each projection runs once)."""
        while True:
            done = figures_of(trial)  # again after a check lists parameters apart: the later losses too
            per = worst_over(done)
            failing = sorted((p for p, f in per.items() if judged(f) < gate.min_cosine),
                             key=lambda p: per[p]["cosine"])
            missing = [i for i in range(len(done)) if any(judged(done[i][p]) < gate.min_cosine for p in failing)]
            pending = [i for i in missing if i in unresolved]
            if pending:  # a miss under a loss whose precision is unchecked: check it, then judge again
                for index in pending:
                    resolve(index)
                continue
            unfloored = [i for i in missing if i not in floored]
            if any(per[p].get("tail") for p in failing):  # a miss only the losses' tail predicts: the rounding
                unfloored += [i for i in range(len(done)) if i not in floored and i not in unfloored]  # check too
            if not unfloored:
                return per, failing
            floor(unfloored)  # then judge again

    def figures_of(trial: Decision, every: bool = False) -> List[Dict[str, Dict[str, Any]]]:
        """The figures of the plan ``trial`` under each loss in use, in order, up to the first under which a
        parameter misses (the repair's trial plans mostly miss: the rest would cost a backward each and change
        nothing), or with ``every`` under all of them; each loss's gradient is computed once per plan, those
        still missing in one forward (``measure``)."""
        key, trial = _planned(trial)
        done = cache.setdefault(key, [])
        kept = ahead.setdefault(key, {})
        while len(done) < len(losses) and len(done) in kept:  # measured ahead of confirmation (``prefetch``)
            done.append(kept.pop(len(done)))
        if len(done) < len(losses) and (every or not any(_misses(figures, gate.min_cosine) for figures in done)):
            rewritten, _ = apply_decision(base, config, trial, ctx)
            if first[0]:  # the plan as given (a trial may leave a unit unrewritten that needs another)
                first[0] = False
                wanted = sum(len(us) for us in trial.values())
                missing = [f"{t} {u}" for t, us in trial.items() if us for u in sorted(set(us) -
                           set(rewritten_units(rewritten, t)))]
                if wanted and len(missing) == wanted:  # a graph the plan does not rewrite would pass unchecked
                    raise MemoptError(f"the fidelity gate's graph of {type(model).__name__} has none of the plan's "
                                      f"{wanted} units ({', '.join(missing[:3])} ...): a memopt bug; "
                                      f"Config(fidelity=None) skips the gate")
                if missing:
                    log.info("memopt: fidelity gate on %s: %d of the plan's units rewrite under another unit's "
                             "name: %s", type(model).__name__, len(missing), ", ".join(missing[:4]))
            # a plan new to the gate is measured under the first ``least`` losses from one forward (stopping at a
            # miss, as the repair's trial plans mostly do): one that passes needs them all
            measure(rewritten, done, kept, len(losses) if every or done else max(len(losses), least), every)
        return done

    def _planned(trial: Decision) -> Tuple[tuple, Decision]:
        trial = {t: dict(us) for t, us in trial.items()}
        coupled(trial, couplings)
        return _key(trial), trial

    def measure(rewritten: fx.GraphModule, done: List[Dict[str, Dict[str, Any]]], kept: Dict[int, Any], upto: int,
                every: bool) -> None:
        """A plan's figures under losses ``len(done)`` to ``upto`` from one forward and a backward each, up to the
        first under which a parameter misses unless ``every``; those past the losses in use go to ``kept``. Where the
        gate pairs, the losses past the first ``least`` (whose eager gradients are not kept) are measured beside the
        eager step (``paired_grads``: a second forward of the plan, once it passed the first ones)."""
        start, measured = len(done), []

        def take(exact: List[Optional[torch.Tensor]], approx: List[Optional[torch.Tensor]]) -> bool:
            index = start + len(measured)
            measured.append(parameter_fidelity(names, exact, approx, gate.tiny, invariant))
            if index < len(losses):
                done.append(measured[-1])
            else:
                kept[index] = measured[-1]
            return not every and _misses(measured[-1], gate.min_cosine)

        first = range(start, upto if not pairing[0] else max(start, min(upto, least)))  # under kept references
        while True:
            if first:
                exact = [exact_grads(i) for i in first]  # first: another step inside would restore the weights
                done_before = len(measured)
                training_grads(rewritten, model, sliced_args, sliced_kwargs, rng, list(map(loss_at, first)),
                               stop=lambda approx: take(exact[len(measured) - done_before], approx), keep=False)
                steps[0] += len(measured) - done_before
                if len(measured) - done_before < len(first) or (not every and _misses(measured[-1], gate.min_cosine)):
                    return
            later = range(start + len(measured), upto)
            if not later:
                return
            # paired: each loss's eager gradients made beside the plan's and dropped with them
            count, conflict = paired_grads(model, rewritten, model, sliced_args, sliced_kwargs, rng,
                                           list(map(loss_at, later)), take)
            steps[0] += 2 * count
            if not conflict or (not every and measured and _misses(measured[-1], gate.min_cosine)):
                return
            pairing[0] = False  # one side changes in place a tensor the other saved: the rest as before, kept
            first = range(start + len(measured), upto)

    def prefetch(trial: Decision) -> None:
        """Ahead of confirming ``trial`` on loss after loss: its figures under every loss up to ``most`` from one
        forward (stopping at a miss), so that each loss confirmation adds costs a backward, not a step."""
        key, trial = _planned(trial)
        done, kept = cache.setdefault(key, []), ahead.setdefault(key, {})
        if len(done) == len(losses) and not kept and not any(_misses(f, gate.min_cosine) for f in done):
            measure(apply_decision(base, config, trial, ctx)[0], done, kept, most, False)

    def confirm(decision: Decision) -> Tuple[Dict[str, Dict[str, Any]], List[str]]:
        """``evaluate`` on ``least`` losses at least and, while the plan passes by less than MARGIN, on further
        ones up to ``most``: one projection's cosine of a small parameter sways with the projection near the bar, so
        a plan that passes is confirmed on independent ones, and repaired on the worst of them if it misses."""
        per_parameter, failing = evaluate(decision)
        while not failing and len(losses) < most and (
                len(losses) < least or per_min(per_parameter) < gate.min_cosine + MARGIN):
            if len(losses) >= least:
                prefetch(decision)
            losses.append(loss_at(len(losses)))
            exact_step(len(losses) - 1)
            per_parameter, failing = evaluate(decision)
        return per_parameter, failing

    def resort(decision: Decision, weights: Dict[Tuple[str, str], float], per_parameter, failing, round_: int):
        """The last resort (the rounds are spent and the plan still misses: never ship it, the rule is never to
        differ silently from eager PyTorch) on copies: lossy units after the failing parameters go exact, the
        fewest that pass (_fewest_exact, in the order of their measured effect: MEASURED_ORDER); if all of them do
        not suffice, lossy units of the whole plan the same way. Returns (decision, weights, changes,
        per_parameter, failing, its note, the missed parameters). What it ships is checked on the first
        ``PROJECTIONS`` losses at least (the rounds confirm only plans that pass: they may have run on one)."""
        decision, weights = {t: dict(us) for t, us in decision.items()}, dict(weights)
        if len(losses) < least:
            while len(losses) < least:
                losses.append(loss_at(len(losses)))
                exact_step(len(losses) - 1)
            per_parameter, failing = evaluate(decision)
        missed = {p: per_parameter[p]["cosine"] for p in failing}
        notes, note = [], None
        for scope in ("after the failing parameters", "of the plan"):
            lossy = {k: v for k, v in lossy_nodes.items() if k[1] in decision.get(k[0], {})}
            keys = sorted(lossy) if scope == "of the plan" else sorted(
                {k for p in failing for k in after(base.graph, p, reach(lossy, p))})
            if not keys:
                continue
            candidates = len(keys)
            order = weights
            if len(keys) <= MEASURED_ORDER:  # each candidate's own effect, measured: one trial plan per unit
                score = sum(per_parameter[p]["cosine"] for p in failing)
                order = {k: sum(evaluate(_without(decision, [k]))[0][p]["cosine"] for p in failing) - score
                         for k in keys}
            keys = _fewest_exact(keys, decision, order, lambda trial: not evaluate(trial)[1])
            for technique, unit in keys:
                del decision[technique][unit]
                weights.pop((technique, unit), None)
            extra = coupled(decision, couplings, weights)
            shown = ", ".join(f"{t} {u}" for t, u in keys[:4]) + (f" and {len(keys) - 4} more" * (len(keys) > 4))
            worst_missed = min(missed, key=missed.get)
            note = (f"last resort after {round_} round{'s' * (round_ != 1)}: {len(keys)} of the {candidates} "
                    f"lossy units {scope} -> exact ({shown}; the rounds left {len(missed)} parameters below "
                    f"{gate.min_cosine}, worst {worst_missed} {missed[worst_missed]:.4f})")
            notes.extend([note] + extra)
            per_parameter, failing = evaluate(decision)
            if not failing:
                break
        return decision, weights, notes, per_parameter, failing, note, missed

    decision = {t: dict(us) for t, us in decision.items()}
    changes: List[str] = []
    radius = 4
    before = None
    table, early = freed_table(units), None
    bests: Dict[str, float] = {}  # each failing parameter's best cosine so far
    fewest, stalled = len(names) + 1, 0
    for round_ in range(gate.max_rounds + 1):
        changes.extend(coupled(decision, couplings, weights))
        per_parameter, failing = confirm(decision)
        before = before or {"parameter": failing[0] if failing else None,
                            "cosine": per_parameter[failing[0]]["cosine"] if failing else per_min(per_parameter)}
        if not failing or round_ == gate.max_rounds or verify_only:
            break
        if round_ == EARLY_RESORT:  # the last resort here too, kept if it frees more than the rounds' plan
            early = (len(changes), *resort(decision, weights, per_parameter, failing, round_))
        gained = [p for p in failing if p in bests and per_parameter[p]["cosine"] >= bests[p] + STALL_GAIN]
        for p in failing:  # a parameter newly below the bar is no progress
            bests[p] = max(bests.get(p, -2.0), per_parameter[p]["cosine"])
        if gained or len(failing) < fewest:
            fewest, stalled = min(fewest, len(failing)), 0
        else:
            stalled += 1
            if stalled >= STALL_ROUNDS and round_ >= EARLY_RESORT:  # never fewer rounds than before rounds grew
                changes.append(f"rounds stopped after {round_}: the last {stalled} lifted none of the "
                               f"{len(failing)} parameters below {gate.min_cosine} (worst {failing[0]} "
                               f"{per_parameter[failing[0]]['cosine']:.4f})")
                break
        gated = sum(not f["excluded"] for f in per_parameter.values())
        techniques = sorted(t for t, us in decision.items() if any((t, u) in lossy_nodes for u in us))
        if len(failing) > max(WIDESPREAD * gated, WIDESPREAD_LEAST) and techniques:
            # bits first: every unit of a technique made exact gives back most of its savings (194 8-bit codes of
            # timm XCiT went exact beside twelve 4-bit chains, where the few-bit GELUs' error was the cause)
            trials = {t: _raise_all(decision, config, t, set(lossy_nodes), weights, to_exact=False)
                      for t in techniques}
            trials = {t: trial for t, trial in trials.items() if trial[1]} or \
                {t: _raise_all(decision, config, t, set(lossy_nodes), weights) for t in techniques}
            scored = sorted((len(evaluate(d)[1]), -per_min(evaluate(d)[0]), t) for t, (d, _, _) in trials.items())
            technique = scored[0][2]
            decision, moves, weights = trials[technique]
            changes.append(f"{technique}, every unit one level up: {moves} ({len(failing)} of {gated} parameters "
                           f"below {gate.min_cosine}, worst {failing[0]} {per_parameter[failing[0]]['cosine']:.4f})")
            continue
        lossy = {k: v for k, v in lossy_nodes.items() if k[1] in decision.get(k[0], {})}
        touched = set()
        for parameter in failing:
            for key in responsible(base.graph, parameter, reach(lossy, parameter), weights, radius):
                if key not in touched:
                    touched.add(key)
                    changes.append(f"{_raise(decision, config, *key, weights)} (for {parameter}, cosine "
                                   f"{per_parameter[parameter]['cosine']:.4f})")
        if not touched:
            radius += 2  # every unit near the failing parameters is exact already: look further
    last_resort = None
    if failing and not verify_only and early is not None and round_ == EARLY_RESORT:
        # the rounds stopped where the last resort was already applied: that is the result, not a second one
        decision, weights, notes, per_parameter, failing, last_resort, missed = early[1:]
        changes.extend(notes)
        early = None
    elif failing and not verify_only:
        decision, weights, notes, per_parameter, failing, last_resort, missed = resort(
            decision, weights, per_parameter, failing, round_)
        changes.extend(notes)
    if early is not None and not early[5]:
        # the last resort at EARLY_RESORT rounds passed too: keep whichever of the two frees more (the planner's
        # bytes), the rounds' plan where they tie or cannot be compared (MobileNetV2's repairs after 6 rounds
        # lost most of what the earlier last resort kept)
        late, soon = freed_by(decision, table), freed_by(early[1], table)
        if failing or (late is not None and soon is not None and soon > late):
            decision, weights, notes, per_parameter, failing, last_resort, missed = early[1:]
            other = "misses the bar" if failing else f"frees {late / 2 ** 20:.2f} MiB"
            changes = changes[:early[0]] + notes + [
                f"kept the last resort after {EARLY_RESORT} rounds: it frees {(soon or 0) / 2 ** 20:.2f} MiB where "
                f"the plan of {round_} rounds {other}"]
            round_, stalled = EARLY_RESORT, 0
    for _ in range(RESORT_CONFIRMS if last_resort is not None and not verify_only else 0):
        # the last resort chose the fewest exact units that pass the losses then in use: what it ships is
        # confirmed as every passing plan is, and made exact further where a new projection misses (timm
        # MobileNetV2-035 and EfficientViT-M0 at 8x128 shipped last-resort plans checked on 2 and 3 losses)
        per_parameter, failing = confirm(decision)
        if not failing:
            break
        decision, weights, notes, per_parameter, failing, _, _ = resort(decision, weights, per_parameter, failing,
                                                                        round_)
        changes.extend(notes)
    if last_resort is not None:
        worst_missed = min(missed, key=missed.get)
        log.warning("memopt: %s: the fidelity gate's %d round(s) left %d parameters below cosine %s (worst %s at "
                    "%.4f); rather than ship approximate gradients it made lossy units exact, so the plan saves "
                    "less: %s. To keep the savings, %slower FidelityConfig.min_cosine, or accept the "
                    "approximate gradients with Config(fidelity=None).",
                    type(model).__name__, round_, len(missed), gate.min_cosine, worst_missed,
                    missed[worst_missed], last_resort,
                    "" if stalled >= STALL_ROUNDS else "raise FidelityConfig.max_rounds, ")
    report = gate_report(per_parameter, failing, invariant, min_cosine=gate.min_cosine, slice=which, rounds=round_,
                         changes=changes, passed=not failing, last_resort=last_resort, steps=steps[0],
                         projections=len(losses), user_loss=loss_fn is not None, before=before)
    log.info("memopt: fidelity gate on %s: %d rounds, %d steps, %d changes, %.2f s", type(model).__name__, round_,
             steps[0], len(changes), time.perf_counter() - start)
    return decision, report


def _lossy(option: Dict[str, Any]) -> bool:
    """Whether an option (a ``Plan.units`` entry's chosen one, or a part of it) approximates a gradient (a fidelity
    proxy above zero)."""
    return option["technique"] != "exact" and option["fidelity"] > 0


def has_lossy_units(units: List[Dict[str, Any]]) -> bool:
    return any(_lossy(u["chosen"]) for u in units)
