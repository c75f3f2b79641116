"""The build step: capture, plan, lower and pack a model into one offline model."""

from tessel.builder.pipeline import BuiltModel, build, save

__all__ = ["BuiltModel", "build", "save"]
