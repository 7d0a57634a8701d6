"""CPU schedule for a reduction kernel that produces one static row ([1, ..., 1, N], the
RMSNorm of one decode token in a static batch-1 bucket): element-wise chains inlined,
serial. dlight's CPU Reduction rule parallelizes the outermost spatial loop it finds; with
no batch loop left that is the N-wide weight cast, and every one of its N iterations then
recomputed the whole row: 190 us per RMSNorm of 576 (11 ms of a 49 ms decode step) where
a serial row takes ~1 us. Dynamic-batch kernels ([batch, 1, N]) are not one row and keep
dlight's rule.
"""

from __future__ import annotations

from tvm.s_tir import dlight as dl

from .cpu_matmul import _normalized, _static


class CPUSingleRowReduction(dl.ScheduleRule):
    def apply(self, func, target, tunable):
        out = func.params[-1] if getattr(func, "params", None) else None
        shape = getattr(out, "shape", None)
        if not shape or any(_static(d) != 1 for d in shape[:-1]) or _static(shape[-1]) is None:
            return None
        found = _normalized(func, target)
        if found is None:
            return None
        sch, infos, _ = found
        if all(b.is_injective() for b in infos):
            return None  # no reduction: CPUElementwise's
        return sch
