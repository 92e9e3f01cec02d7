"""Capture: the model as an fx graph (fx.symbolic_trace, else torch.export), the fix-ups that make a
trace run what eager runs (autograd Functions, fused norms, attention masks, cached constants),
and the soundness check against eager PyTorch."""
