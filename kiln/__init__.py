"""Kiln: compile a decoder-only LLM once per target, serve it with a small runtime."""

from kiln.runtime.version import __version__

__all__ = ["__version__"]
