"""Importing this package registers every Kiln converter (one module per op family)."""

from . import attention, elementwise, linear, norm, paged_attention, quantized, rotary, tensor  # noqa: F401
