"""Reversible segments: configuration, the plan-time numeric check, and ``convert`` (opt-in
rewiring of plain residual runs into a reversible form, which changes the model's function)."""
from memopt.reversible.config import ReversibleConfig
from memopt.reversible.convert import Conversion, ConvertedModule, convert

__all__ = ["Conversion", "ConvertedModule", "ReversibleConfig", "convert"]
