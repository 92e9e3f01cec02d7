"""Layer 1: runtime pieces shared by the techniques' autograd ops: exact b-bit packing, the fused
CPU kernels (built from ``kernels.c`` on first use), few-bit backward's Triton kernels (``triton_fewbit``, optional),
the one switch choosing between them (``kernels``: ``MEMOPT_KERNELS``), autocast and RNG replay, memory layouts."""
