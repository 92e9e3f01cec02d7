"""The fidelity gate: exact and rewritten training steps on a slice compared per parameter, the
repair of a failing plan, the scope of lossy units, and the parameters whose gradients a
rewrite cannot move."""
