"""CPU schedule for "NT" matmuls: C[m, n] = sum_k A[m, k] * W[n, k] (+ element-wise
epilogue), the shape of every projection in the model (weights stay [N, K]).

Each (mt x nt) output tile keeps mt*nt vector accumulators of ``vec`` lanes along K, so
both operands are read contiguously; after the K loop the lanes are summed. Tiles are
distributed over cores. With mt = nt = 4 and 16 fp32 lanes (AVX-512) that is 16
accumulators in registers and 8 loads per 16 FMAs: compute-bound for prefill, and for
decode (m = 1) four weight rows stream at once, bandwidth-bound as it should be.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial

from ..quant_weights import DEQUANTIZE_W


def _indices(read) -> list:
    """A read's index expressions, without those of unit dims (indexed by 0)."""
    shape = read.source.shape
    return [r.min for r, dim in zip(read.region, shape)
            if not (isinstance(dim, tirx.IntImm) and int(dim) == 1 and isinstance(r.min, tirx.IntImm))]


def _one_element(read) -> bool:
    """The read touches one element per iteration (no slices)."""
    return all(isinstance(r.extent, tirx.IntImm) and int(r.extent) == 1 for r in read.region)


def _same(exprs, variables) -> bool:
    return len(exprs) == len(variables) and all(e.same_as(v) for e, v in zip(exprs, variables))


def _static(extent) -> int | None:
    return int(extent) if isinstance(extent, (int, tirx.IntImm)) else None


def vector_lanes(target) -> int:
    """fp32 lanes of the target's widest vector unit (16 with AVX-512, 8 with AVX2)."""
    from tvm.target import codegen

    try:
        bits = int(codegen.llvm_get_vector_width(target))
    except Exception:  # not an LLVM CPU target
        bits = 256
    return max(4, bits // 32)


def _normalized(func, target, keep: tuple[str, ...] = ()):
    """(schedule, block infos, kept block rvs) of an LLVM-target PrimFunc with element-wise
    chains inlined, except blocks named in ``keep`` (left to the rule, and not among the
    infos), or None when the function is not one these rules schedule."""
    if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    kept, rest = [], []
    for b in infos:
        (kept if sch.get(b.block_rv).name_hint in keep else rest).append(b)
    infos = try_inline_contiguous_spatial(sch, rest)
    return None if infos is None else (sch, infos, [b.block_rv for b in kept])


GEMV_MAX_ROWS = 4  # static row counts up to this are scheduled as decode GEMVs
L1_BYTES = 32 * 1024  # per-core L1 data cache of the CPUs measured (Zen 4)


class CPUMatmulNT(dl.ScheduleRule):
    def __init__(self, gemm_nt: int = 8, gemv_nt: int = 4, float_gemv_nt: int = 8, vec: int | None = None,
                 static_mt: int = 4, static_nt: int = 4):
        # Measured on Zen 4: 8 rows per tile reach ~100 GFLOP/s on prefill GEMMs. Decode
        # GEMVs (SmolLM2-135M, python -m kiln.bench.dispatch, alternating artifacts):
        # float32 weights stream faster 8 rows at a time (decode_b1 20.8-22.8 vs 21.8-24.1
        # ms, B=4 27.4-27.5 vs 29.3-29.4 ms); weights dequantized in the loop (int8) 4 rows
        # at a time (decode_b1 11.4 vs 13.6 ms, B=4 19.3 vs 24.5 ms).
        # A static row count (a prefill bucket) divisible by static_mt tiles rows too:
        # static_mt x static_nt accumulators take static_mt + static_nt loads per
        # static_mt * static_nt FMAs (4 x 4: 8 per 16; one row of 8: 9 per 8).
        self.gemm_nt, self.gemv_nt, self.float_gemv_nt, self.vec = gemm_nt, gemv_nt, float_gemv_nt, vec
        self.static_mt, self.static_nt = static_mt, static_nt

    def apply(self, func, target, tunable):
        found = _normalized(func, target, keep=(DEQUANTIZE_W,))
        if found is None:
            return None
        sch, infos, dequantize = found
        if len(dequantize) > 1:
            return None
        reductions = [b for b in infos if b.is_reduction()]
        if len(reductions) != 1 or infos[0] is not reductions[0] or len(infos) > 2:
            return None
        main = reductions[0]
        epilogue = infos[1] if len(infos) == 2 else None
        if epilogue is not None and not epilogue.is_injective():
            return None
        kinds = "".join(i.kind for i in main.iters)
        if not (kinds.endswith("SR") and set(kinds[:-1]) == {"S"}):
            return None
        k_extent = _static(main.iters[-1].dom)
        n_extent = _static(main.iters[-2].dom)
        form = self._nt_form(sch, main.block_rv)
        if k_extent is None or form is None:
            return None
        shared, float_weight = form
        vec = self.vec or vector_lanes(target)
        if k_extent % vec:
            return None
        # M is one dynamic dim (a decode batch) or a static handful of rows (a static
        # decode bucket): a GEMV. Anything else: a GEMM.
        m_sizes = [_static(i.dom) for i in main.iters[shared:-2]]
        gemv = (len(m_sizes) == 1 and m_sizes[0] is None) or (
            None not in m_sizes and math.prod(m_sizes) <= GEMV_MAX_ROWS)
        # A staged weight (the lowering's choice for prefill) marks a GEMM whatever the shapes say.
        gemv = gemv and not dequantize
        nt = (self.float_gemv_nt if float_weight else self.gemv_nt) if gemv else self.gemm_nt
        m_rows = math.prod(m_sizes) if None not in m_sizes else None
        mt = 1
        if (not gemv and m_rows is not None and m_rows % self.static_mt == 0
                and nt * k_extent * 4 > L1_BYTES):
            # A static row count whose weight tile (nt rows of K) no longer stays in L1 across
            # rows: tile rows too. 128 x 1536 -> 576 (the down projection): 100-150 vs 50-85
            # GFLOP/s. Where the tile fits (K = 576) one row at a time measured as fast or faster.
            mt, nt = self.static_mt, self.static_nt
        if n_extent is not None:
            nt = max(d for d in (nt, 8, 4, 2, 1) if d <= nt and n_extent % d == 0)

        # rfactor first, on the untiled nest: the partial-sum block rf[..., n, ki] takes
        # the K loops, the lane-sum block (main) keeps the others. The lane axis goes last
        # in rf's buffer so each accumulator row is contiguous.
        *_, k = sch.get_loops(main.block_rv)
        ko, ki = sch.split(k, [None, vec])
        out_dims = len(sch.get(main.block_rv).writes[0].region)  # unit dims included
        rf = sch.rfactor(ki, factor_axis=out_dims)
        # Tile rf: loops over the dims W shares with A (attention's batch and heads), then
        # N tiles across cores, every M row in turn, the K loop, and nt accumulator rows of
        # vec lanes. M is not tiled (tails would put a predicate in the vector loop) and
        # dynamic dims are not fused (div/mod by a variable is not affine, and parallel
        # loops need affine bindings).
        *r_s, r_n, r_ko, r_ki = sch.get_loops(rf)
        r_b, r_m = r_s[:shared], r_s[shared:]
        r_no, r_ni = sch.split(r_n, [None, nt])
        if mt > 1:
            # Static rows: mt of them share each weight vector load.
            r_mo, r_mi = sch.split(sch.fuse(*r_m) if len(r_m) > 1 else r_m[0], [None, mt])
            sch.reorder(*r_b, r_no, r_mo, r_ko, r_mi, r_ni, r_ki)
            r_m = [r_mo]
            sch.unroll(r_mi)
        else:
            sch.reorder(*r_b, r_no, *r_m, r_ko, r_ni, r_ki)
            if gemv and not float_weight and k_extent % (2 * vec) == 0:
                # Two vectors of K per step, unrolled: a quantization block (>= 32 wide)
                # spans both, so each row's scale (and minimum) is loaded, converted from
                # float16 and broadcast once per block instead of once per vector.
                r_ko, r_kp = sch.split(r_ko, [None, 2])
                sch.unroll(r_kp)
        anchor = r_m[-1] if r_m else r_no
        sch.parallel(r_no)  # before the consumers move in (their lane-sum is a reduction)
        # Sum the lanes (and run the epilogue) right after each row's K loop, so the
        # accumulators are one [nt, vec] register block.
        sch.reverse_compute_at(main.block_rv, anchor, preserve_unit_loops=True)
        # The lane sum's loops come out as (lane, ..., n): LLVM then vectorizes across the
        # nt outputs with strided gathers, which costs as much as the K loop. Lane innermost
        # makes each output one horizontal sum of a contiguous accumulator row.
        n_iters = len(sch.get(main.block_rv).iter_vars)
        lane_loop, *rest = sch.get_loops(main.block_rv)[-n_iters:]
        if _static(sch.get(lane_loop).extent) == vec:
            sch.reorder(*rest, lane_loop)
        if epilogue is not None:
            sch.reverse_compute_at(epilogue.block_rv, anchor, preserve_unit_loops=True)
        # The accumulator block stays in "global" scope: TVM turns small constant-size
        # global allocations into stack allocas (which LLVM keeps in registers) but
        # heap-allocates "local" ones per iteration, whose pointer LLVM must assume aliases
        # the operands, storing every accumulator after every FMA.
        sch.vectorize(r_ki)
        sch.unroll(r_ni)
        sch.decompose_reduction(rf, r_ko)  # zero the accumulators before the K loop
        if dequantize:
            # A GEMM reuses each weight for every row of A: dequantize this core's tile of
            # nt weight rows ([nt, K] float32, a few tens of KB, cache-resident) once,
            # before the M loop, instead of once per row inside the K loop.
            sch.compute_at(dequantize[0], r_no, preserve_unit_loops=True)
            *_, w_k = sch.get_loops(dequantize[0])
            # One vector of lanes at a time: a K-wide vector (576-1536 lanes) would take
            # LLVM minutes to legalize.
            _, w_ki = sch.split(w_k, [None, vec])
            sch.vectorize(w_ki)
        return sch

    @staticmethod
    def _nt_form(sch, block_rv) -> tuple[int, bool] | None:
        """If the block is C[b.., m.., n] += A[b.., m.., k] * W[b.., n, k]: (the number of
        leading b dims W shares with A (0 for a weight matrix), whether W is float32 read
        as is (not dequantized / converted from stored values)); else None."""
        block = sch.get(block_rv)
        iter_vars = [iv.var for iv in block.iter_vars]
        if len(block.reads) > 2:
            return (0, False) if _dequantized_nt(block.reads, iter_vars) else None
        if len(block.reads) != 2:
            return None
        a_read, w_read = block.reads
        if not _one_element(w_read):
            return None  # W must be read one element per iteration (no slices)
        w, a = _indices(w_read), _indices(a_read)
        shared = len(w) - 2
        if shared < 0 or not _same(w, iter_vars[:shared] + iter_vars[-2:]):
            return None
        if not _same(a, iter_vars[:-2] + iter_vars[-1:]):
            return None
        return shared, w_read.source.dtype == "float32"


def _dequantized_nt(reads, iter_vars) -> bool:
    """C[m.., n] += A[m.., k] * f(Q[g(n, k)], S[n, h(k)], ..): a weight-only quantized NT
    matmul (``lower/quant_weights.py``). A is read at (m.., k); every other read is one
    element of a weight-side buffer at indices that are expressions of n and k alone (the
    row-interleaved data mixes them: [n // 4, k // 16 * 64 + n % 4 * 16 + k % 16])."""
    n, k = iter_vars[-2], iter_vars[-1]
    is_a = [_same(_indices(r), iter_vars[:-2] + [k]) for r in reads]
    if sum(is_a) != 1:
        return False
    for r, a in zip(reads, is_a):
        if a:
            continue
        if not _one_element(r):
            return False
        idx = [e.min for e in r.region]
        if not idx or not all(v.same_as(k) or v.same_as(n) for e in idx for v in tirx.analysis.undefined_vars(e)):
            return False
    return True


class CPUMatmulNN(dl.ScheduleRule):
    """C[b.., m, n] = sum_k A[b.., m, k] * B[b.., k, n] with a static, vector-sized n
    (attention's probabilities x values, n = head_dim): each output row's n values are
    vector accumulators, A[m, k] is broadcast and B's row k loaded whole."""

    def __init__(self, max_vectors: int = 8, vec: int | None = None):
        self.max_vectors, self.vec = max_vectors, vec

    def apply(self, func, target, tunable):
        found = _normalized(func, target)
        if found is None:
            return None
        sch, infos, _ = found
        if len(infos) != 1 or not infos[0].is_reduction():
            return None
        main = infos[0]
        kinds = "".join(i.kind for i in main.iters)
        if not (kinds.endswith("SR") and set(kinds[:-1]) == {"S"}) or len(main.iters) < 3:
            return None
        vec = self.vec or vector_lanes(target)
        n_extent = _static(main.iters[-2].dom)
        if n_extent is None or n_extent % vec or n_extent // vec > self.max_vectors:
            return None
        if not self._is_nn(sch, main.block_rv):
            return None
        *outer, m, n, k = sch.get_loops(main.block_rv)
        no, ni = sch.split(n, [None, vec])
        sch.reorder(*outer, m, k, no, ni)
        acc = sch.cache_write(main.block_rv, 0, "local")
        sch.reverse_compute_at(acc, m, preserve_unit_loops=True)
        sch.parallel(m)
        sch.vectorize(ni)
        sch.unroll(no)
        sch.vectorize(sch.get_loops(acc)[-1])
        sch.decompose_reduction(main.block_rv, k)
        return sch

    @staticmethod
    def _is_nn(sch, block_rv) -> bool:
        block = sch.get(block_rv)
        if len(block.reads) != 2:
            return False
        iter_vars = [iv.var for iv in block.iter_vars]
        a, b = (_indices(read) for read in block.reads)
        return _same(a, iter_vars[:-2] + iter_vars[-1:]) and _same(b, iter_vars[:-3] + [iter_vars[-1], iter_vars[-2]])
