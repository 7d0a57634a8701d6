"""Kiln's own schedule rules (dlight-style), tried before TVM's defaults."""

from .cpu_elementwise import CPUElementwise
from .cpu_matmul import CPUMatmulNN, CPUMatmulNT

__all__ = ["CPUElementwise", "CPUMatmulNN", "CPUMatmulNT"]
