"""The build step: capture, plan, lower and pack a model into one offline model."""

from tessel.build.builder import BuiltModel, build, save

__all__ = ["BuiltModel", "build", "save"]
