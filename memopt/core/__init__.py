"""Layer 0: what every other layer may use: errors, node.meta keys, validation, state snapshots,
inputs, byte counting, units, and the registry of functions rewritten graphs call."""
