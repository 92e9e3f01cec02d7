"""Graph rewrites. Importing this package registers every pass with ``passes.base.register_pass``."""
from passes import fewbit, recompute, reversible, stash  # noqa: F401  (registers the passes)
