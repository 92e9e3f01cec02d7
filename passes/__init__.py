"""Graph rewrites. Importing this package registers every pass with ``passes.base.register_pass``."""
from passes import fewbit  # noqa: F401  (registers the few-bit pass)
