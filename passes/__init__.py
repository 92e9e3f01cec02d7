"""Graph rewrites. Importing this package registers every pass with ``memopt.passes.base.register_pass``."""
from memopt.passes import fewbit, recompute  # noqa: F401  (registers the passes)
from memopt.passes.reversible import segments  # noqa: F401  (registers the reversible pass)
from memopt.passes.stash import chains  # noqa: F401  (registers the stash pass)
