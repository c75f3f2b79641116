"""mindspore.parallel-style API for PyTorch: Layout, strategy files, checkpoint conversion."""
