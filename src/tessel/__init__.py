"""tessel: build, partition and deploy PyTorch foundation models across many devices."""

__version__ = "0.1.0"
