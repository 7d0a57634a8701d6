"""Default schedule rules per target (dlight), with Kiln's guards around them."""

from __future__ import annotations

from tvm import tirx
from tvm.s_tir import dlight as dl


class StaticInnerOutput(dl.ScheduleRule):
    """Apply ``rule`` only to kernels whose output's innermost dim is static.

    dlight's GPU Matmul / GeneralReduction rules assume the dynamic extent is an outer
    (batch / sequence) axis; for attention scores over a growing past ([..., T]) they emit
    a dynamically sized register array, which CUDA codegen rejects. Such kernels fall
    through to the next rule instead.
    """

    def __init__(self, rule: dl.ScheduleRule):
        self.rule = rule

    def apply(self, func, target, tunable):
        if not isinstance(func, tirx.PrimFunc) or not func.params:
            return None
        out = func.params[-1]
        shape = getattr(out, "shape", None)
        if shape and not isinstance(shape[-1], tirx.IntImm):
            return None
        return self.rule.apply(func, target, tunable)


def default_rules(kind: str) -> list[dl.ScheduleRule]:
    if kind == "cuda":
        return [
            StaticInnerOutput(dl.gpu.Matmul()),
            dl.gpu.GEMV(),
            dl.gpu.LowBatchGEMV(),
            dl.gpu.Reduction(),
            StaticInnerOutput(dl.gpu.GeneralReduction()),
            dl.gpu.Fallback(),
        ]
    from .schedules import CPUElementwise, CPUMatmulNN, CPUMatmulNT, CPUSingleRowReduction

    return [CPUMatmulNT(), CPUMatmulNN(), dl.cpu.GEMV(), CPUSingleRowReduction(), dl.cpu.Reduction(),
            CPUElementwise()]
