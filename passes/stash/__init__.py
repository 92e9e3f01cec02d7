"""The stash passes: BatchNorm-activation chains (chains), weight consumers' forms (forms), generic
codes of what other ops keep (generic, coded, weights), compact exact extras, weight-gradient chunks."""
