"""Kiln's version, recorded in every artifact manifest."""

__version__ = "0.1.0"
