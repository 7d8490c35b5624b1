"""The package's version, in a module of its own so that any layer may read it without the
top-level package (whose names load the offline engine)."""

__version__ = "0.1.0"
