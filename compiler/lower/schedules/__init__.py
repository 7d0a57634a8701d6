"""Kiln's own schedule rules (dlight-style), tried before TVM's defaults."""

from .cpu_elementwise import CPUElementwise
from .cpu_matmul import CPUMatmulNN, CPUMatmulNT
from .cpu_single_row import CPUSingleRowReduction

__all__ = ["CPUElementwise", "CPUMatmulNN", "CPUMatmulNT", "CPUSingleRowReduction"]
