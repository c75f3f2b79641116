"""Model capture: an nn.Module (or a saved .pt2) becomes an ATen graph with shapes on every node."""

from tessel.capture.export import CapturedModel, capture, capture_training, load_model_spec

__all__ = ["CapturedModel", "capture", "capture_training", "load_model_spec"]
