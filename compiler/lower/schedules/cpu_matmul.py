"""CPU schedules for "NT" matmuls: C[m, n] = sum_k A[m, k] * W[n, k] (+ element-wise
epilogue), the shape of every projection in the model. Three forms, by how W is stored
and how many rows A has:

* K-lane (``CPUMatmulNT`` proper): each (1 x nt) output tile keeps nt vector accumulators
  of ``vec`` lanes along K, so both operands are read contiguously; after the K loop the
  lanes are summed. For weights stored by rows ([N, K]: int8 / int4 / fp16, row-interleaved
  in ``lower/quant_weights.py``) read by decode GEMVs (m dynamic or <= 4), dequantized in
  registers, and for GEMMs with a dynamic row count.
* Packed (``_packed_gemm``): C tiles of mt rows x nv vectors of N; the K loop broadcasts
  A[m, k] against row k of a K-major panel of W, so the accumulators are whole output
  vectors and no lanes are summed. Weights stored by rows are copied into such a panel
  per core (dequantized first) for static row counts (prefill buckets).
* Float32 panels: float32 weights are stored as K-major panels on CPU
  (``quant_weights.float_panel_storage``) and read in place in the packed form by every
  row count: static ones directly, dynamic ones in padded row tiles (``_row_tiled``).
"""

from __future__ import annotations

import math

from tvm import s_tir, sym, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial

from ..quant_weights import DEQUANTIZE_W, ROW_TILES


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
STAGE_K = 64  # columns of a packed GEMM's weight panel dequantized at a time


class CPUMatmulNT(dl.ScheduleRule):
    def __init__(self, gemm_nt: int = 8, gemv_nt: int = 4, float_gemv_nt: int = 8, vec: int | None = None,
                 packed_mt: int = 8, packed_vectors: int = 2):
        # Measured on Zen 4: 8 rows per tile reach ~100 GFLOP/s on prefill GEMMs. Decode
        # GEMVs (SmolLM2-135M, python -m kiln.bench.dispatch, alternating artifacts):
        # float32 weights stream faster 8 rows at a time (decode_b1 20.8-22.8 vs 21.8-24.1
        # ms, B=4 27.4-27.5 vs 29.3-29.4 ms); weights dequantized in the loop (int8) 4 rows
        # at a time (decode_b1 11.4 vs 13.6 ms, B=4 19.3 vs 24.5 ms).
        # A static row count (a prefill bucket) divisible by 4 takes the packed GEMM
        # (``_packed_gemm``): packed_mt rows x packed_vectors vectors of outputs per tile.
        self.gemm_nt, self.gemv_nt, self.float_gemv_nt, self.vec = gemm_nt, gemv_nt, float_gemv_nt, vec
        self.packed_mt, self.packed_vectors = packed_mt, packed_vectors

    def apply(self, func, target, tunable):
        tiled = _row_tiled(func, target, self.vec)
        if tiled is not None:
            return tiled
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
        shared, float_weight, panel = form
        vec = self.vec or vector_lanes(target)
        m_sizes = [_static(i.dom) for i in main.iters[shared:-2]]
        m_rows = math.prod(m_sizes) if None not in m_sizes else None
        if panel:
            # Float32 panels (lower/quant_weights.py): the broadcast form for every row count.
            if panel % vec:
                return None
            mt = math.gcd(self.packed_mt, m_rows) if m_rows is not None and m_rows % 4 == 0 else 1
            return _packed_gemm(sch, main.block_rv, epilogue and epilogue.block_rv, [], mt, panel // vec, vec,
                                staged=False)
        if k_extent % vec:
            return None
        # M is one dynamic dim (a decode batch) or a static handful of rows (a static
        # decode bucket): a GEMV. Anything else: a GEMM.
        gemv = (len(m_sizes) == 1 and m_sizes[0] is None) or (
            None not in m_sizes and math.prod(m_sizes) <= GEMV_MAX_ROWS)
        # A staged weight (the lowering's choice for prefill) marks a GEMM whatever the shapes say.
        gemv = gemv and not dequantize
        nt = (self.float_gemv_nt if float_weight else self.gemv_nt) if gemv else self.gemm_nt
        if (not gemv and shared == 0 and m_rows is not None and m_rows % 4 == 0
                and n_extent is not None and n_extent % vec == 0):
            mt = math.gcd(self.packed_mt, m_rows)
            nv = max(d for d in range(1, self.packed_vectors + 1) if n_extent % (d * vec) == 0)
            return _packed_gemm(sch, main.block_rv, epilogue and epilogue.block_rv, dequantize, mt, nv, vec)
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
            _stage_dequantized(sch, dequantize[0], r_no, vec)
        return sch

    @staticmethod
    def _nt_form(sch, block_rv) -> tuple[int, bool, int] | None:
        """If the block is C[b.., m.., n] += A[b.., m.., k] * W[b.., n, k]: (the number of
        leading b dims W shares with A (0 for a weight matrix), whether W is float32 read
        as is (not dequantized / converted from stored values), the panel width P when W
        is float32 panels read at [n // P, k, n % P] (else 0)); else None."""
        block = sch.get(block_rv)
        iter_vars = [iv.var for iv in block.iter_vars]
        if len(block.reads) > 2:
            return (0, False, 0) if _dequantized_nt(block.reads, iter_vars) else None
        if len(block.reads) != 2:
            return None
        a_read, w_read = block.reads
        if not _one_element(w_read):
            return None  # W must be read one element per iteration (no slices)
        w, a = _indices(w_read), _indices(a_read)
        if not _same(a, iter_vars[:-2] + iter_vars[-1:]):
            return None
        panel = _panel_width(w_read, block)
        if panel:
            return 0, True, panel
        shared = len(w) - 2
        if shared < 0 or not _same(w, iter_vars[:shared] + iter_vars[-2:]):
            return None
        return shared, w_read.source.dtype == "float32", 0


def _panel_width(read, block) -> int:
    """P when ``read`` is one float32 element of panels [N / P, K, P] at [n // P, k, n % P]
    (``lower/quant_weights.py``; n, k the block's last two iterators), else 0."""
    shape = read.source.shape
    if read.source.dtype != "float32" or len(shape) != 3 or _static(shape[2]) is None:
        return 0
    p = int(shape[2])
    idx = [r.min for r in read.region]
    analyzer = sym.Analyzer()
    for iv in block.iter_vars:  # a single panel's n // P is simplified to 0 given n < P
        analyzer.bind(iv.var, iv.dom)
    n, k = (iv.var for iv in block.iter_vars[-2:])
    want = (tirx.floordiv(n, p), k, tirx.floormod(n, p))
    return p if all(analyzer.can_prove_equal(i, w) for i, w in zip(idx, want)) else 0


def _stage_dequantized(sch, dequantize, loop, vec: int) -> None:
    """A GEMM reuses each weight for every row of A: dequantize this core's tile of weight
    rows ([nt, K] float32, a few tens of KB, cache-resident) once per ``loop`` iteration,
    before the M loop, instead of once per row inside the K loop."""
    sch.compute_at(dequantize, loop, preserve_unit_loops=True)
    *_, w_k = sch.get_loops(dequantize)
    # One vector of lanes at a time: a K-wide vector (576-1536 lanes) would take LLVM
    # minutes to legalize.
    _, w_ki = sch.split(w_k, [None, vec])
    sch.vectorize(w_ki)


def _packed_gemm(sch, main, epilogue, dequantize, mt: int, nv: int, vec: int, staged: bool = True):
    """C[m.., n] = sum_k A[m.., k] * W[n, k] (+ epilogue) with a static row count, as a
    BLAS-style packed GEMM: each core takes a panel of nv * vec output columns and copies
    its weight rows transposed, [K, nv * vec] (dequantized first when quantized), once;
    then for every tile of mt rows the K loop broadcasts A[m, k] and multiplies it into
    the panel's row k, nv vectors: mt * nv accumulators (16 with 8 x 2 on AVX-512), nv + mt
    loads per mt * nv FMAs, and no horizontal sums (the lane axis is N, not K).
    SmolLM2's prefill projections (256 rows, fp32) measured 180-196 GFLOP/s this way on
    two Zen 4 cores, numpy's BLAS 184, the rfactor form above 114-168."""
    *m_loops, n, k = sch.get_loops(main)
    no, ni = sch.split(n, [None, nv * vec])
    if mt > 1:
        mo, mi = sch.split(sch.fuse(*m_loops) if len(m_loops) > 1 else m_loops[0], [None, mt])
        sch.reorder(no, mo, k, mi, ni)
        sch.unroll(mi)
    else:
        # One row at a time (a decode batch, possibly dynamic: not fused, as a variable
        # extent would make the fused index non-affine).
        sch.reorder(no, *m_loops, k, ni)
        mo = m_loops[-1] if m_loops else no
    if staged:
        # The transposed panel: its copy walks K outer and N inner (one vector gathered
        # from nv * vec weight rows per k), which measured fastest for short row counts.
        panel = sch.cache_read(main, 1, "global")
        sch.compute_at(panel, no, preserve_unit_loops=True)
        sch.transform_layout(main, ("read", 1), lambda n, k: (k, n))
        p_n, p_k = sch.get_loops(panel)[-2:]
        sch.reorder(p_k, p_n)
        sch.vectorize(p_n)
        if dequantize:
            # Dequantize STAGE_K columns of the panel's rows at a time ([nv * vec, STAGE_K]
            # float32, 8 KB: L1-resident while the copy gathers it transposed; the whole
            # [nv * vec, K] tile is 72-196 KB and would be gathered from L2).
            k_extent = _static(sch.get(p_k).extent)
            anchor = no
            if k_extent is not None and k_extent % STAGE_K == 0 and k_extent > STAGE_K:
                anchor, _ = sch.split(p_k, [None, STAGE_K])
            _stage_dequantized(sch, dequantize[0], anchor, vec)
    # Accumulators: a [mt, nv * vec] block compacted per tile (a stack alloca LLVM keeps
    # in registers), written out (through the epilogue) after each tile's K loop.
    acc = sch.cache_write(main, 0, "global")
    sch.reverse_compute_at(acc, mo, preserve_unit_loops=True)
    out = acc
    if epilogue is not None:
        sch.reverse_compute_at(epilogue, mo, preserve_unit_loops=True)
        sch.compute_inline(acc)
        out = epilogue
    sch.parallel(no)
    ni_o, ni_i = sch.split(ni, [nv, vec])
    sch.unroll(ni_o)
    sch.vectorize(ni_i)
    init = sch.decompose_reduction(main, k)
    for block in (init, out):
        _, lanes = sch.split(sch.get_loops(block)[-1], [None, vec])
        sch.vectorize(lanes)
    return sch


def _row_tiled(func, target, vec: int | None):
    """The row-tiled panel matmul (``quant_weights.matmul_nt_te``: ``matmul_row_tiles``
    [tiles, T, N] += x[min(tile * T + j, M - 1), k] * W[n, k], then element-wise
    consumers), or None when ``func`` is not one: each core takes panels of N, each tile
    keeps T x PANEL accumulators (``_packed_gemm``'s form with T rows and no predicate),
    and the consumers run after it, parallel over rows."""
    found = _normalized(func, target)
    if found is None:
        return None
    sch, infos, _ = found
    tiles = [b for b in infos if sch.get(b.block_rv).name_hint == ROW_TILES]
    if len(tiles) != 1 or len(tiles[0].iters) != 4 or not all(b.is_injective() for b in infos if b is not tiles[0]):
        return None
    main = tiles[0].block_rv
    block = sch.get(main)
    panel = max((_panel_width(r, block) for r in block.reads), default=0)
    vec = vec or vector_lanes(target)
    consumers = [b.block_rv for b in infos if b is not tiles[0]]
    if not panel:
        if not _quantized_tile_reads(block):
            return None
        _k_lane_tiles(sch, main, vec)
    elif panel % vec:
        return None
    else:
        _broadcast_tiles(sch, main, panel, vec)
    for b in consumers:
        *rows, cols = sch.get_loops(b)
        dynamic = [r for r in rows if _static(sch.get(r).extent) is None]
        if dynamic:
            sch.parallel(dynamic[-1])  # prefill (batch, seq): seq; decode (batch, 1): batch
        if _static(sch.get(cols).extent) is not None and _static(sch.get(cols).extent) % vec == 0:
            _, lanes = sch.split(cols, [None, vec])
            sch.vectorize(lanes)
    return sch


def _quantized_tile_reads(block) -> bool:
    """The row-tile block reads x at (rows of t, j; k) and weight-side buffers at
    expressions of n and k alone (a dequantized weight, ``_dequantized_nt``'s form)."""
    t, j, n, k = (iv.var for iv in block.iter_vars)
    a_reads = 0
    for r in block.reads:
        if not _one_element(r):
            return False
        used = [v for e in (x.min for x in r.region) for v in tirx.analysis.undefined_vars(e)]
        if any(v.same_as(t) or v.same_as(j) for v in used):
            a_reads += 1
        elif not all(v.same_as(n) or v.same_as(k) for v in used):
            return False
    return a_reads == 1


def _k_lane_tiles(sch, main, vec: int) -> None:
    """A quantized decode batch in row tiles: the K-lane form (``CPUMatmulNT``) with the
    tile's T rows side by side, so each dequantized weight vector feeds T FMAs. T x nt
    accumulators of vec lanes stay under TVM's 1 KB stack-allocation limit (a larger
    block goes to the heap, where LLVM must store it after every FMA): nt = 3, or 2."""
    t, j, n, k = sch.get_loops(main)
    k_extent, n_extent, rows = (_static(sch.get(loop).extent) for loop in (k, n, j))
    ko, ki = sch.split(k, [None, vec])
    rf = sch.rfactor(ki, factor_axis=3)  # rf[t, j, n, lane]
    r_t, r_j, r_n, r_ko, r_ki = sch.get_loops(rf)
    nt = 3 if n_extent % 3 == 0 and rows * 3 * vec * 4 < 1024 else 2 if n_extent % 2 == 0 else 1
    r_no, r_ni = sch.split(r_n, [None, nt])
    loops = [r_ko]
    if k_extent % (2 * vec) == 0:  # a block's scale once per two vectors, as in the GEMV
        loops = list(sch.split(r_ko, [None, 2]))
    sch.reorder(r_no, r_t, *loops, r_ni, r_j, r_ki)
    if len(loops) == 2:
        sch.unroll(loops[1])
    sch.unroll(r_ni)
    sch.unroll(r_j)
    sch.vectorize(r_ki)
    sch.parallel(r_no)
    sch.reverse_compute_at(main, r_t, preserve_unit_loops=True)
    n_iters = len(sch.get(main).iter_vars)
    lane_loop, *rest = sch.get_loops(main)[-n_iters:]
    if _static(sch.get(lane_loop).extent) == vec:
        sch.reorder(*rest, lane_loop)
    sch.decompose_reduction(rf, loops[0])


def _broadcast_tiles(sch, main, panel: int, vec: int) -> None:
    """Float32 panels in row tiles: ``_packed_gemm``'s broadcast form with T rows."""
    t, j, n, k = sch.get_loops(main)
    no, ni = sch.split(n, [None, panel])
    sch.reorder(no, t, k, j, ni)
    sch.unroll(j)
    sch.parallel(no)
    ni_o, ni_i = sch.split(ni, [None, vec])
    sch.unroll(ni_o)
    sch.vectorize(ni_i)
    init = sch.decompose_reduction(main, k)
    _, lanes = sch.split(sch.get_loops(init)[-1], [None, vec])
    sch.vectorize(lanes)


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
