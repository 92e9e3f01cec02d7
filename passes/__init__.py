"""Graph rewrites. Importing this package registers every pass with ``memopt.passes.base.register_pass``."""
from memopt.passes import fewbit, recompute, reversible, stash  # noqa: F401  (registers the passes)
