"""Kernels and the data types they read: ``ops`` (a :class:`~bargein.kernels.ops.KernelSet`
that picks the native or the PyTorch path, resolved once per engine), ``native`` (our C
kernels, built on first use) and ``block_quant`` (exact Q4/Q8 weight blocks). The model
imports from here; nothing here imports the model."""
