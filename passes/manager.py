"""The pass manager: run passes in ``memopt.techniques.TECHNIQUES`` order, lint and recompile after each that
modified the graph, name the pass on failure."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from torch import fx

from memopt.core.errors import MemoptError, PassError
from memopt.passes.base import PassContext, PassFn, PassResult, registered_pass
from memopt.core import counters


@dataclass
class PassRecord:
    name: str
    modified: bool


def passes_for(config: Any) -> List[Tuple[str, PassFn, Any]]:
    """The passes a ``memopt.Config`` turns on, in field order (``Config``'s technique fields follow
    ``TECHNIQUES``): one per technique field not None whose config type has a registered pass."""
    selected = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None or not dataclasses.is_dataclass(value):
            continue
        handler = registered_pass(type(value))
        if handler is not None:
            selected.append((handler.name, handler.run, value))
    return selected


@counters.counted("pass_runs")
def run_passes(gm: fx.GraphModule, passes: Sequence[Tuple[str, PassFn, Any]],
               ctx: Optional[PassContext] = None) -> Tuple[fx.GraphModule, List[PassRecord]]:
    ctx = PassContext() if ctx is None else ctx
    records = []
    passes = list(passes)
    for index, (name, fn, cfg) in enumerate(passes):
        try:
            result = fn(gm, cfg, dataclasses.replace(ctx, later=tuple(passes[index + 1:])))
            if not isinstance(result, PassResult):
                raise TypeError(f"a pass must return PassResult, got {type(result).__name__}")
            gm = result.graph_module
            if result.modified:  # an unmodified graph is still the code it was compiled to (recompiling a
                gm.graph.lint()  # graph recompiles every graph submodule too: blocks recomputed from codes)
                gm.recompile()
        except MemoptError as e:
            raise type(e)(f"pass '{name}' failed: {e}") from e
        except Exception as e:  # noqa: BLE001 - re-raised with the pass named
            raise PassError(f"pass '{name}' failed: {type(e).__name__}: {e}") from e
        records.append(PassRecord(name, result.modified))
    return gm, records
