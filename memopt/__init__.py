"""memopt: make PyTorch training fit in less memory by rewriting the model's graph.

Public API: ``optimize``, ``Config``, ``estimate``, ``measure``, ``load``, ``OptimizedModule``,
``Plan`` and the errors ``MemoptError``, ``TraceError``, ``BudgetError``, ``PassError``.
"""
from memopt.core.errors import BudgetError, MemoptError, PassError, TraceError
from memopt.config import Config, FidelityConfig
from memopt.fewbit.config import FewBitConfig
from memopt.fewbit.tables import fewbit_table
from memopt.recompute.config import RecomputeConfig
from memopt.reversible.config import ReversibleConfig
from memopt.stash.config import StashConfig
from memopt.record.plan import NodePlan, Plan
from memopt.builder.optimized import OptimizedModule
from memopt.api import EstimateReport, estimate, load, optimize
from memopt.record.measure import Measurement, measure
from memopt import kernel_probes  # noqa: F401 (registers the Triton kernels' first-use probes: memopt.runtime.verify)

__version__ = "0.1.0"

__all__ = [
    "BudgetError", "Config", "EstimateReport", "FidelityConfig", "FewBitConfig", "RecomputeConfig", "ReversibleConfig", "StashConfig", "fewbit_table", "Measurement", "MemoptError", "NodePlan", "OptimizedModule",
    "PassError", "Plan", "TraceError", "estimate", "load", "measure", "optimize", "__version__",
]
