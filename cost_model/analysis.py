"""Annotate a captured graph: per-node shapes, FLOPs and exactly which storages autograd keeps.

Runs the graph once on fake tensors (no memory) through an ``fx.Interpreter``. After each node
finishes, the tensors autograd packed during that node are attributed to it (after, not during:
ops such as ReLU pack their own output before returning it). Each saved storage is classified as
a parameter, a buffer, an input, a node's output (attributed to its producer) or an extra (a
storage born inside the op: BN statistics, pooling indices, dropout noise). The same run then
does the backward pass (and an optimizer step when one is named) under ``LiveStorageTracker``,
which gives the peak of one training step from real lifetimes.

Results go to ``node.meta["memopt_cost"]`` (a ``NodeCost``) and into the returned ``Estimate``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode

from memopt.cost_model.fake import RealDtypes, fake_copy
from memopt.cost_model.op_registry import describe_target, op_kind
from memopt.cost_model.optimizers import resolve_optimizer
from memopt.cost_model.step import LossFn, compute_loss
from memopt.cost_model.storage import LiveStorageTracker, SavedTensorRecorder, distinct_bytes, storage_key
from memopt.core.errors import MemoptError
from memopt.core.meta import META_KEY, STATE_CATEGORIES

from memopt.capture.trace import flat_inputs, structured_output
from memopt.core import counters



@dataclass
class SavedRef:
    """A storage that a node keeps for backward."""

    key: int
    nbytes: int
    category: str  # parameter | buffer | input | activation | extra
    source: str  # the node whose output it is ("" for extras born inside the node)
    savers: List[str] = field(default_factory=list)  # every node keeping this storage (filled at the end)


@dataclass
class NodeCost:
    name: str
    op: str  # the op kind from the registry, or the target's name when the registry has none
    kind: Optional[str]
    target: str
    shapes: List[tuple]
    dtypes: List[str]
    out_bytes: int
    flops: int
    saved: List[SavedRef] = field(default_factory=list)
    # per output tensor: (storage key, the node whose output that storage is: a view's base's producer), so a
    # pass can tell which storage an argument lives in; and whether the output requires grad
    storages: List[Tuple[int, str]] = field(default_factory=list)
    requires_grad: List[bool] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        """Bytes of the distinct non-state storages this node keeps (shared ones count fully here)."""
        return sum({s.key: s.nbytes for s in self.saved if s.category not in STATE_CATEGORIES}.values())


@dataclass
class StorageRecord:
    key: int
    nbytes: int
    category: str
    producer: str
    savers: List[str] = field(default_factory=list)


# the parts of a step's peak no rewrite of the activations removes (keys of ``Estimate.breakdown``)
FLOOR_PARTS = ("parameters_and_buffers", "inputs", "optimizer_state", "all_gradients")


@dataclass
class Estimate:
    """The cost model's answer for one training step. All byte counts are ints."""

    nodes: Dict[str, NodeCost]
    storages: Dict[int, StorageRecord]
    saved_bytes: int
    peak_bytes: int
    breakdown: Dict[str, int]
    device: str
    # nodes whose outputs are alive at the forward/backward peak (empty when the peak is in the
    # optimizer step, or without simulation): freeing what they keep is what lowers that peak
    alive_at_peak: Set[str] = field(default_factory=set)

    def floor_bytes(self) -> int:
        """The least peak any rewrite of the activations can reach on this step: parameters, buffers, inputs,
        optimizer state and every gradient (alive together when backward ends), or the whole peak where it falls in
        the optimizer step (no activation is alive there). 0 without the step's simulation."""
        b = self.breakdown
        if not b or "all_gradients" not in b:
            return 0
        if b.get("peak_in_optimizer_step"):
            return self.peak_bytes
        return sum(b[k] for k in FLOOR_PARTS)

    def saved_by_category(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for rec in self.storages.values():
            out[rec.category] = out.get(rec.category, 0) + rec.nbytes
        return out


def _tensors(value: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class _Annotator(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, recorder: SavedTensorRecorder, flops: FlopCounterMode,
                 state_keys: Dict[int, str]):
        super().__init__(gm)
        self.recorder = recorder
        self.flop_counter = flops
        self.state_keys = state_keys
        self.producer: Dict[int, str] = {}
        self._producer_refs: Dict[int, StorageWeakRef] = {}
        self.producer_op: Dict[str, str] = {}
        self.costs: Dict[str, NodeCost] = {}
        self.modules = dict(gm.named_modules())

    def run_node(self, n: fx.Node) -> Any:
        flops_before = self.flop_counter.get_total_flops()
        self.recorder.take()  # saves between nodes (none expected) are not this node's
        try:
            out = super().run_node(n)
        except MemoptError:
            raise
        except Exception as e:  # re-raised naming the node and the inputs it got
            raise _node_error(n, self.env, e) from e
        outs = _tensors(out)
        for t in outs:
            # a view keeps its base's producer; a dead storage's reused address gets the new one
            key = storage_key(t)
            known = self._producer_refs.get(key)
            if known is None or known.expired():
                self.producer[key] = n.name
                self._producer_refs[key] = StorageWeakRef(t.untyped_storage())
        self.producer_op[n.name] = n.op
        saved = []
        for s in self.recorder.take():
            category = self.state_keys.get(s.key)
            source = self.producer.get(s.key, "")
            if category is None:
                if not source:
                    category = "extra"
                else:
                    category = "input" if self.producer_op.get(source) == "placeholder" else "activation"
            saved.append(SavedRef(s.key, s.nbytes, category, source if category != "extra" else ""))
        kind = op_kind(n, self.modules)
        self.costs[n.name] = NodeCost(
            name=n.name, op=kind or describe_target(n), kind=kind, target=describe_target(n),
            shapes=[tuple(t.shape) for t in outs], dtypes=[str(t.dtype).replace("torch.", "") for t in outs],
            out_bytes=sum(t.numel() * t.element_size() for t in outs),
            flops=int(self.flop_counter.get_total_flops() - flops_before), saved=saved,
            storages=[(storage_key(t), self.producer.get(storage_key(t), n.name)) for t in outs],
            requires_grad=[bool(t.requires_grad) for t in outs],
        )
        return out


def _node_error(n: fx.Node, env: dict[fx.Node, Any], error: Exception) -> MemoptError:
    """A model that fails on its example inputs (integer images, complex values where autograd needs
    floats, a string for a tensor): name the node, what it got and the fix, not torch's internals."""
    got = []
    for arg in n.all_input_nodes:
        value = env.get(arg)
        if isinstance(value, torch.Tensor):
            got.append(f"{arg.name}: {str(value.dtype).replace('torch.', '')}[{','.join(map(str, value.shape))}]")
        elif arg in env:
            got.append(f"{arg.name}: {type(value).__name__} {value!r:.40}")
    first = str(error).strip().splitlines()[0][:300].rstrip(".") if str(error).strip() else ""
    return MemoptError(
        f"the model fails on the example inputs at {n.format_node()} (inputs {', '.join(got) or 'none'}): "
        f"{type(error).__name__}: {first}. Pass example inputs of the dtype, shape and device that training "
        f"uses (floating point where the model computes gradients, e.g. x.float() for integer images); the "
        f"stock model fails on these too.")


@counters.counted("cost_model_runs")
def annotate(gm: fx.GraphModule, args: tuple, kwargs: dict, *, device: Optional[str] = None,
             optimizer: Any = None, loss_fn: Optional[LossFn] = None, simulate: bool = True) -> Estimate:
    """Run the cost model on ``gm`` for the example inputs and write ``node.meta[META_KEY]``.

    ``device`` is the target device ("cpu" default, "cuda" works without a GPU); ``optimizer`` is
    None, a name ("sgd", "adam", "adamw"), an Optimizer class or an instance, whose state is
    simulated too; ``loss_fn`` maps the model output to a scalar (default: sum of every output).
    ``simulate=False`` skips the training-step simulation (attribution of saves only; the
    planner's candidate runs): ``peak_bytes`` is then 0 and ``breakdown`` empty.
    """

    target = torch.device(device or _model_device(gm))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_gm, fargs, fkwargs = fake_copy(gm, args, kwargs, mode, target)
    state_keys = {storage_key(b): "buffer" for b in fake_gm.buffers()}
    state_keys.update({storage_key(p): "parameter" for p in fake_gm.parameters()})
    flat = flat_inputs(fake_gm, fargs, fkwargs)

    # Attribution of saves and FLOPs: forward only, under saved-tensor hooks.
    recorder = SavedTensorRecorder()
    flops = FlopCounterMode(display=False)
    annotator = _Annotator(fake_gm, recorder, flops, state_keys)
    with mode, RealDtypes(), flops, recorder:
        out = annotator.run(*flat, enable_io_processing=False)
    del out

    storages: Dict[int, StorageRecord] = {}
    for cost in annotator.costs.values():
        for s in cost.saved:
            if s.category in STATE_CATEGORIES:
                continue
            rec = storages.setdefault(s.key, StorageRecord(s.key, s.nbytes, s.category, s.source))
            if cost.name not in rec.savers:
                rec.savers.append(cost.name)
    saved_bytes = sum(r.nbytes for r in storages.values())
    for cost in annotator.costs.values():
        for s in cost.saved:
            if s.key in storages:
                s.savers = list(storages[s.key].savers)

    # The autograd engine needs a real CUDA context for backward even on fake tensors, so without
    # a GPU the step's timeline is simulated with CPU kernels (saves above stay CUDA's).
    peak, breakdown, alive = 0, {}, set()
    if simulate:
        sim_device = target
        if target.type == "cuda" and not torch.cuda.is_available():
            sim_device = torch.device("cpu")
        peak, breakdown, alive = simulate_step(gm, args, kwargs, sim_device, optimizer, loss_fn)
        breakdown["peak_simulated_on_" + sim_device.type] = 1
    for node in gm.graph.nodes:
        if node.name in annotator.costs:
            node.meta[META_KEY] = annotator.costs[node.name]
    return Estimate(annotator.costs, storages, saved_bytes, peak, breakdown, str(target), alive)


def simulate_step(gm: fx.GraphModule, args: tuple, kwargs: dict, device: torch.device, optimizer: Any,
                  loss_fn: Optional[LossFn]):
    """Peak bytes of one steady-state training step on fake tensors, its parts at the peak, and the
    nodes whose outputs are alive at the forward/backward peak (empty if the optimizer step peaks).

    Runs without saved-tensor hooks: hooks change when autograd frees saved tensors in backward.
    """

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_gm, fargs, fkwargs = fake_copy(gm, args, kwargs, mode, device)
    params, buffers = list(fake_gm.parameters()), list(fake_gm.buffers())
    flat = flat_inputs(fake_gm, fargs, fkwargs)
    input_tensors = _tensors(flat)
    tracker = LiveStorageTracker(preexisting=params + buffers + input_tensors)
    with mode, RealDtypes(), tracker:
        tracker.phase = "forward"
        interpreter = _ProducerInterpreter(fake_gm, tracker)
        out = interpreter.run(*flat, enable_io_processing=False)
        producer = interpreter.producer
        del interpreter  # its env would keep values alive past their last use
        loss = compute_loss(structured_output(fake_gm, out), loss_fn)
        del out
        boundary = tracker.current
        tracker.phase = "backward"
        loss.backward()
        del loss
        fb_peak, fb_at_peak, in_weight_grad = tracker.peak, tracker.at_peak, tracker.peak_in_weight_grad
        in_recompute = tracker.peak_in_recompute
        made = [p.grad for p in params if p.grad is not None]
        grads, grad_bytes = {tracker.identity(g) for g in made}, distinct_bytes(made)
        opt = _simulate_optimizer(optimizer, params, tracker)

    param_bytes = distinct_bytes(params + buffers)
    input_bytes = distinct_bytes(input_tensors)
    fb_total = opt.state_bytes + fb_peak  # steady state: the optimizer state exists during fwd/bwd
    at_step = opt.step_peak > fb_total
    parts = {"gradients": 0, "activations": 0, "transient": 0}
    for identity, nbytes, phase in (opt.at_peak if at_step else fb_at_peak):
        if identity in opt.state:
            continue
        # forward-born storages alive at the peak are activations; the rest is transient
        part = "gradients" if identity in grads else "activations" if phase == "forward" else "transient"
        parts[part] += nbytes
    breakdown = {
        "parameters_and_buffers": param_bytes,
        "optimizer_state": opt.state_bytes,
        "all_gradients": grad_bytes,  # every gradient of the step, alive together when backward ends
        "inputs": input_bytes,
        **parts,
        "activations_at_boundary": boundary,
        "peak_in_optimizer_step": int(at_step),
        # the forward/backward peak fell inside a weight gradient from a rebuilt input (memopt.core.phase)
        "peak_in_weight_grad": int(in_weight_grad and not at_step),
        # ... inside a recomputed block's backward (batch chunks of it can lower the peak: memopt.recompute.ops)
        "peak_in_recompute": int(in_recompute and not at_step),
    }
    alive = set() if at_step else {producer[i] for i, _, _ in fb_at_peak if i in producer}
    return param_bytes + input_bytes + max(fb_total, opt.step_peak), breakdown, alive


class _ProducerInterpreter(fx.Interpreter):
    """Records which node created each storage the tracker follows."""

    def __init__(self, gm: fx.GraphModule, tracker: LiveStorageTracker) -> None:
        super().__init__(gm)
        self.tracker = tracker
        self.producer: Dict[tuple, str] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        for t in _tensors(out):
            identity = self.tracker.identity(t)
            if identity is not None:
                self.producer.setdefault(identity, n.name)
        return out


@dataclass
class _OptimizerSim:
    state_bytes: int = 0
    step_peak: int = 0
    at_peak: List[tuple] = field(default_factory=list)
    state: set = field(default_factory=set)


def _simulate_optimizer(optimizer: Any, params: List[torch.Tensor], tracker: LiveStorageTracker) -> _OptimizerSim:
    """Two optimizer steps on the fake parameters: the first creates the state, the second is measured."""
    resolved = resolve_optimizer(optimizer)
    if resolved is None:
        return _OptimizerSim()
    cls, kwargs = resolved
    opt = cls([p for p in params if p.requires_grad and p.grad is not None], **kwargs)
    tracker.phase = "optimizer"
    opt.step()  # the first step creates the state; the second is the steady state we budget for
    tracker.reset_peak()
    opt.step()
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return _OptimizerSim(distinct_bytes(state), tracker.peak, tracker.at_peak,
                         {tracker.identity(t) for t in state})


def _model_device(gm: fx.GraphModule) -> str:
    for t in list(gm.parameters()) + list(gm.buffers()):
        return str(t.device)
    return "cpu"
