"""Layer 1: runtime pieces shared by the techniques' autograd ops: exact b-bit packing, the fused
CPU kernels (built from ``kernels.c`` on first use), autocast and RNG replay, memory layouts."""
