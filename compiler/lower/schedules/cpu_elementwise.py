"""CPU schedule for kernels with no reduction (element-wise chains, splits, packing):
the outermost non-unit loop across cores, the innermost vectorized when its extent is a
static multiple of the vector width. Without it such a kernel runs as serial scalar loops
(dlight has no CPU rule for it): fine for one decode token, ~100x too slow for a
512-token prefill's [512, 3072] activation.
"""

from __future__ import annotations

from tvm.s_tir import dlight as dl

from .cpu_matmul import _normalized, _static, vector_lanes


class CPUElementwise(dl.ScheduleRule):
    def apply(self, func, target, tunable):
        found = _normalized(func, target)
        if found is None:
            return None
        sch, infos, _ = found
        if not infos or any(not b.is_injective() for b in infos):
            return None
        vec = vector_lanes(target)
        for info in infos:  # each remaining block writes an output of the kernel
            loops = sch.get_loops(info.block_rv)
            if not loops:
                continue
            inner = loops[-1]
            extent = _static(sch.get(inner).extent)
            if extent is not None and extent % vec == 0 and extent > vec:
                _, lanes = sch.split(inner, [None, vec])
                sch.vectorize(lanes)
                loops = sch.get_loops(info.block_rv)[:-1]
            # Cores take the outermost loop that is not a unit dim (a batch of 1).
            outer = next((lp for lp in loops if _static(sch.get(lp).extent) != 1), None)
            if outer is not None and all(_static(sch.get(lp).extent) == 1 for lp in loops[:loops.index(outer)]):
                sch.parallel(outer)
        return sch
