"""tessel's version, in a module of its own: the package's root and the builder, which stamps it
into every package, both read it."""

__version__ = "0.1.0"
