"""Building an optimized module: the pipeline (capture -> annotate -> check -> plan -> gate), the
per-submodule fallback, re-use of a plan for new input shapes, and the module users train."""
