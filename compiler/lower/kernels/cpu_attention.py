"""Kiln's CPU attention kernels for TVM's paged KV cache.

They have exactly the signatures (and the log2-based softmax-state convention) of TVM's
``_attention_decode_cpu`` / ``_attention_prefill_cpu`` / ``_attention_prefill_ragged_cpu``,
so the cache calls them in their place; those are single-threaded scalar loops. The
decode and paged-prefill kernels split the work over cores by (token, query head) and
vectorize over the head dim:

* keys are visited a block (one page) at a time: the block's scores, their max, one
  rescale of the running output, then the weighted value rows (online softmax per block);
  a block is a [rows, d] view of the page;
* dot products accumulate VEC lanes at a time, then sum the lanes.

The ragged-prefill kernel (a prompt's tokens attending to each other: most of a prefill's
attention) takes tiles of 16 queries of one head and vectorizes over the queries instead,
so no lanes are summed at all (``prefill_ragged``).

Softmax state: scores s = q.k * sm_scale * log2(e); lse = m + log2(sum exp2(s - m)), so the
cache can merge partial results (prefix blocks, ragged + paged parts) as TVM's do.
Rotary embedding is never applied here (Kiln's graphs rotate q and k themselves), and
sliding windows are not supported (TVM's kernels remain in those slots).

Stored form (``kiln.runtime.kv_layout``): the cache's tensors are float32 *words*
([.., words] per head row); the kernels view a K/V row as ``head_dim`` float32, float16 or
int8 elements (int8 rows end in their float32 scale, applied once per score and once per
weight), and a query / output head as ``q_split`` word rows. The reads convert in
registers; no float copy of a cached row is made.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from kiln.runtime.kv_layout import KVLayout

LOG2E = math.log2(math.exp(1))
LN2 = math.log(2)
NEG = -5e4
VEC = 16
BLOCK = 16  # keys per block in the ragged kernel
QT = VEC  # queries per task in the ragged kernel: one vector of lanes
HALF = 8  # keys whose scores accumulate side by side there
STORAGE = {"float32": "float32", "float16": "float16", "int8": "int8"}


def _exp2_poly(x):
    """2^x for x <= 0 as a vectorizable expression: 2^x = 2^n * 2^f, n = round(x), f in
    [-1/2, 1/2]: a degree-6 Taylor series of e^(f ln 2) (relative error ~1e-7), 2^n built in
    the exponent bits. The exp2 intrinsic would be one scalar libm call per key (no vector
    math library)."""
    x = T.max(x, T.float32(-126))
    n = T.floor(x + T.float32(0.5))
    f = (x - n) * T.float32(LN2)
    return (T.float32(1) + f * (T.float32(1) + f * (T.float32(1 / 2) + f * (T.float32(1 / 6) + f * (
        T.float32(1 / 24) + f * (T.float32(1 / 120) + f * T.float32(1 / 720))))))) * T.reinterpret(
        "float32", T.shift_left(T.Cast("int32", n) + 127, 23))


def _views(layout: KVLayout):
    """(element dtype of a stored row, elements per row, whether rows carry a scale)."""
    return STORAGE[layout.dtype], layout.words * layout.elems_per_word, layout.dtype == "int8"


def _core(layout: KVLayout, block: int):
    """The online-softmax steps every kernel shares, as TVMScript macros. Per task:
    acc [d] running output, lane [VEC] dot-product lanes, scores and weights [block],
    state [3] = (running max m, running sum, block max)."""
    d, w, qs = layout.head_dim, layout.words, layout.q_split
    _, _, scaled = _views(layout)
    lanes = VEC if d % VEC == 0 else 1

    @T.macro
    def start(acc: T.Buffer, state: T.Buffer):
        state[0] = T.float32(NEG)
        state[1] = T.float32(0)
        for i in T.vectorized(d):
            acc[i] = T.float32(0)

    @T.macro
    def attend(acc: T.Buffer, lane: T.Buffer, scores: T.Buffer, weights: T.Buffer, state: T.Buffer, q: T.Buffer,
               row: T.int32, h: T.int32, keys: T.Buffer, values: T.Buffer, key_words: T.Buffer,
               value_words: T.Buffer, rows: T.int32, sm_scale: T.float32):
        # keys, values: [block, elements] views of the stored rows; key_words, value_words:
        # the same rows as [block, words] float32 (int8: the scale is the last word);
        # q[row, h, :head_dim] is the query.
        state[2] = T.float32(NEG)
        for j in T.serial(rows):
            for l in T.vectorized(lanes):
                lane[l] = T.float32(0)
            for c in T.serial(d // lanes):
                for l in T.vectorized(lanes):
                    lane[l] = lane[l] + q[row, h, c * lanes + l] * T.Cast("float32", keys[j, c * lanes + l])
            # Sum the lanes by halving vector adds (a serial scalar sum of 16 lanes cost
            # more than the dot product itself). With lanes = 1 there is nothing to sum
            # (and TVM refuses a vectorized loop of extent 0).
            if lanes > 1:
                for l in T.vectorized(lanes // 2):
                    lane[l] = lane[l] + lane[l + lanes // 2]
                for l in T.vectorized(lanes // 4):
                    lane[l] = lane[l] + lane[l + lanes // 4]
                for l in T.vectorized(lanes // 8):
                    lane[l] = lane[l] + lane[l + lanes // 8]
            if scaled:
                scores[j] = (lane[0] + T.if_then_else(lanes > 1, lane[lanes // 16], T.float32(0))) * key_words[
                    j, w - 1] * sm_scale * T.float32(LOG2E)
            else:
                scores[j] = (lane[0] + T.if_then_else(lanes > 1, lane[lanes // 16], T.float32(0))) * sm_scale * T.float32(
                    LOG2E)
            state[2] = T.max(state[2], scores[j])
        # One rescale of the running output per block.
        m_new: T.let[T.float32] = T.max(state[0], state[2])
        alpha: T.let[T.float32] = T.exp2(state[0] - m_new)
        state[0] = m_new
        state[1] = state[1] * alpha
        for i in T.vectorized(d):
            acc[i] = acc[i] * alpha
        # The block's weights in one vector pass (rows past ``rows`` are computed from
        # stale scores and never used).
        for j in T.vectorized(block):
            weights[j] = _exp2_poly(scores[j] - state[0])
        for j in T.serial(rows):
            state[1] = state[1] + weights[j]
            if scaled:
                weights[j] = weights[j] * value_words[j, w - 1]
            for i in T.vectorized(d):
                acc[i] = acc[i] + weights[j] * T.Cast("float32", values[j, i])

    @T.macro
    def finish(acc: T.Buffer, state: T.Buffer, output: T.Buffer, lse: T.Buffer, row: T.int32, h: T.int32):
        # output: [rows, heads, q_stride] view; lse: [rows, heads * q_split] (each word row
        # of a head carries the head's lse, so the cache's merges treat them alike).
        inv: T.let[T.float32] = T.if_then_else(state[1] > T.float32(0), T.float32(1) / state[1], T.float32(0))
        for i in T.vectorized(d):
            output[row, h, i] = acc[i] * inv
        for s in T.serial(qs):
            lse[row, h * qs + s] = T.if_then_else(state[1] > T.float32(0), state[0] + T.log2(state[1]), T.float32(NEG))

    return lanes, start, attend, finish


def _check(layout: KVLayout, dtype: str) -> None:
    if dtype != "float32":
        raise ValueError(f"Kiln's CPU attention kernels take float32 activations, got {dtype}")


def decode_paged(layout: KVLayout, page_size: int = 16, dtype: str = "float32"):
    _check(layout, dtype)
    h_kv, h_q, d, w, qs = layout.num_kv_heads, layout.num_heads, layout.head_dim, layout.words, layout.q_stride
    hq_c = layout.cache_q_heads
    group = h_q // h_kv
    store, elems, _ = _views(layout)
    lanes, start, attend, finish = _core(layout, page_size)

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle, var_length_info: T.handle, k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle, output_handle: T.handle, lse_handle: T.handle,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "kiln_batch_decode_paged_kv_cpu"})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q_words = T.match_buffer(Q_handle, (B, hq_c, w), "float32")
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, w), "float32")
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output_words = T.match_buffer(output_handle, (B, hq_c, w), "float32")
        lse = T.match_buffer(lse_handle, (B, hq_c), "float32")
        last_page_len = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_info_elem_offset)
        Q = T.decl_buffer((B, h_q, qs), "float32", data=Q_words.data)
        output = T.decl_buffer((B, h_q, qs), "float32", data=output_words.data)

        for bh in T.parallel(B * h_q):
            with T.sblock("attn"):
                T.reads()  # opaque: the regions depend on the page table read inside
                T.writes()
                acc = T.sblock_alloc_buffer((d,), "float32")
                lane = T.sblock_alloc_buffer((lanes,), "float32")
                scores = T.sblock_alloc_buffer((page_size,), "float32")
                weights = T.sblock_alloc_buffer((page_size,), "float32")
                state = T.sblock_alloc_buffer((3,), "float32")
                b: T.let[T.int32] = bh // h_q
                h: T.let[T.int32] = bh % h_q
                first: T.let[T.int32] = page_table_indptr[b]
                num_pages: T.let[T.int32] = page_table_indptr[b + 1] - first
                start(acc, state)
                for p in T.serial(num_pages):
                    page: T.let[T.int32] = page_table_values[first + p]
                    k_row: T.let[T.int32] = ((page * 2) * h_kv + h // group) * page_size
                    v_row: T.let[T.int32] = ((page * 2 + 1) * h_kv + h // group) * page_size
                    keys = T.decl_buffer((page_size, elems), store, data=pages.data, elem_offset=k_row * elems)
                    values = T.decl_buffer((page_size, elems), store, data=pages.data, elem_offset=v_row * elems)
                    key_words = T.decl_buffer((page_size, w), "float32", data=pages.data, elem_offset=k_row * w)
                    value_words = T.decl_buffer((page_size, w), "float32", data=pages.data, elem_offset=v_row * w)
                    attend(acc, lane, scores, weights, state, Q, b, h, keys, values, key_words, value_words,
                           T.if_then_else(p == num_pages - 1, last_page_len[b], page_size), sm_scale)
                finish(acc, state, output, lse, b, h)

    return batch_decode_paged_kv


def prefill_paged(layout: KVLayout, page_size: int = 16, dtype: str = "float32"):
    _check(layout, dtype)
    h_kv, h_q, d, w, qs = layout.num_kv_heads, layout.num_heads, layout.head_dim, layout.words, layout.q_stride
    hq_c = layout.cache_q_heads
    group = h_q // h_kv
    store, elems, _ = _views(layout)
    lanes, start, attend, finish = _core(layout, page_size)

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_cpu(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "kiln_batch_prefill_paged_kv_cpu"})
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q_words = T.match_buffer(var_q, (total_len, hq_c, w), "float32")
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, w), "float32")
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output_words = T.match_buffer(var_output, (total_len, hq_c, w), "float32")
        lse = T.match_buffer(var_lse, (total_len, hq_c), "float32")
        last_page_len = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset)
        q = T.decl_buffer((total_len, h_q, qs), "float32", data=q_words.data)
        output = T.decl_buffer((total_len, h_q, qs), "float32", data=output_words.data)

        for b in T.serial(batch_size):
            for th in T.parallel((q_indptr[b + 1] - q_indptr[b]) * h_q):
                with T.sblock("attn"):
                    T.reads()  # opaque: the regions depend on the index tables read inside
                    T.writes()
                    acc = T.sblock_alloc_buffer((d,), "float32")
                    lane = T.sblock_alloc_buffer((lanes,), "float32")
                    scores = T.sblock_alloc_buffer((page_size,), "float32")
                    weights = T.sblock_alloc_buffer((page_size,), "float32")
                    state = T.sblock_alloc_buffer((3,), "float32")
                    h: T.let[T.int32] = th % h_q
                    token: T.let[T.int32] = q_indptr[b] + th // h_q
                    first: T.let[T.int32] = page_indptr[b]
                    num_pages: T.let[T.int32] = page_indptr[b + 1] - first
                    kv_len: T.let[T.int32] = T.if_then_else(num_pages > 0, (num_pages - 1) * page_size
                                                            + last_page_len[b], 0)
                    # Causal: query row i sees keys j < kv_len - qo_len + i + 1 (bottom-right).
                    visible: T.let[T.int32] = T.if_then_else(
                        causal > 0, T.min(kv_len - (q_indptr[b + 1] - q_indptr[b]) + th // h_q + 1, kv_len), kv_len)
                    start(acc, state)
                    for p in T.serial((visible + page_size - 1) // page_size):
                        page: T.let[T.int32] = page_values[first + p]
                        k_row: T.let[T.int32] = ((page * 2) * h_kv + h // group) * page_size
                        v_row: T.let[T.int32] = ((page * 2 + 1) * h_kv + h // group) * page_size
                        keys = T.decl_buffer((page_size, elems), store, data=pages.data, elem_offset=k_row * elems)
                        values = T.decl_buffer((page_size, elems), store, data=pages.data, elem_offset=v_row * elems)
                        key_words = T.decl_buffer((page_size, w), "float32", data=pages.data, elem_offset=k_row * w)
                        value_words = T.decl_buffer((page_size, w), "float32", data=pages.data,
                                                    elem_offset=v_row * w)
                        attend(acc, lane, scores, weights, state, q, token, h, keys, values, key_words, value_words,
                               T.min(visible - p * page_size, page_size), sm_scale)
                    finish(acc, state, output, lse, token, h)

    return batch_prefill_paged_kv_cpu


def prefill_ragged(layout: KVLayout, dtype: str = "float32"):
    """Attention of each new token to its sequence's new tokens (ragged K / V, in the
    stored form: the graph packs them before the cache appends them), in tasks of
    QT queries of one head: the tile's queries are
    copied transposed ([d, QT], pre-scaled) once, then each key's scores against all QT
    queries are one vector (d FMAs with the key's elements broadcast), so the softmax
    state, the block max and the weights are vectors over queries and nothing is summed
    across lanes; each query's output row then takes its weights, broadcast, times the
    value rows. Keys past a query's causal limit (or the sequence) score NEG."""
    _check(layout, dtype)
    h_kv, h_q, d, w, qs = layout.num_kv_heads, layout.num_heads, layout.head_dim, layout.words, layout.q_stride
    hq_c, q_split = layout.cache_q_heads, layout.q_split
    group = h_q // h_kv
    store, elems, scaled = _views(layout)
    scale = T.float32(LOG2E)

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
        var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "global_symbol": "kiln_batch_prefill_ragged_kv_cpu"})
        batch_size = T.int32()
        qo_len_total = T.int32()
        kv_len_total = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_words = T.match_buffer(var_q, (qo_len_total, hq_c, w), "float32")
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k_words = T.match_buffer(var_k, (kv_len_total, h_kv, w), "float32")
        v_words = T.match_buffer(var_v, (kv_len_total, h_kv, w), "float32")
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len_total,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output_words = T.match_buffer(var_output, (qo_len_total, hq_c, w), "float32")
        lse = T.match_buffer(var_lse, (qo_len_total, hq_c), "float32")
        q = T.decl_buffer((qo_len_total, h_q, qs), "float32", data=q_words.data)
        k = T.decl_buffer((kv_len_total, h_kv, elems), store, data=k_words.data)
        v = T.decl_buffer((kv_len_total, h_kv, elems), store, data=v_words.data)
        output = T.decl_buffer((qo_len_total, h_q, qs), "float32", data=output_words.data)

        for b in T.serial(batch_size):
            # Tasks head-major: a core's contiguous share of them holds whole heads, so the
            # causal triangle's cheap and dear tiles spread evenly.
            for task in T.parallel((q_indptr[b + 1] - q_indptr[b] + QT - 1) // QT * h_q):
                with T.sblock("attn"):
                    T.reads()  # opaque: the regions depend on the index tables read inside
                    T.writes()
                    qt = T.sblock_alloc_buffer((d, QT), "float32")  # the tile's queries, transposed
                    st = T.sblock_alloc_buffer((BLOCK, QT), "float32")  # scores, then weights [key, query]
                    acc = T.sblock_alloc_buffer((QT, d), "float32")
                    dots = T.sblock_alloc_buffer((HALF, QT), "float32")
                    row = T.sblock_alloc_buffer((d,), "float32")
                    m = T.sblock_alloc_buffer((QT,), "float32")
                    total = T.sblock_alloc_buffer((QT,), "float32")
                    alpha = T.sblock_alloc_buffer((QT,), "float32")
                    limit = T.sblock_alloc_buffer((QT,), "int32")  # keys each query sees
                    qo_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                    tiles: T.let[T.int32] = (qo_len + QT - 1) // QT
                    h: T.let[T.int32] = task // tiles
                    row0: T.let[T.int32] = task % tiles * QT  # first query of the tile, in its sequence
                    rows: T.let[T.int32] = T.min(qo_len - row0, QT)
                    kv_first: T.let[T.int32] = kv_indptr[b]
                    kv_len: T.let[T.int32] = kv_indptr[b + 1] - kv_first
                    for r in T.vectorized(QT):
                        # Causal: query i sees keys j < kv_len - qo_len + i + 1 (bottom-right).
                        limit[r] = T.if_then_else(causal > 0, T.min(kv_len - qo_len + row0 + r + 1, kv_len), kv_len)
                        m[r] = T.float32(NEG)
                        total[r] = T.float32(0)
                    for c, r in T.grid(d, QT):  # rows past the sequence repeat its last query
                        qt[c, r] = q[q_indptr[b] + row0 + T.min(r, rows - 1), h, c] * sm_scale * scale
                    for r in T.serial(QT):
                        for c in T.vectorized(d):
                            acc[r, c] = T.float32(0)
                    for blk in T.serial((limit[rows - 1] + BLOCK - 1) // BLOCK):
                        # HALF keys side by side: independent accumulators sharing each load of
                        # qt[c] (one key at a time is a chain of d dependent FMAs), in a
                        # buffer small enough to be a stack alloca that LLVM keeps in registers
                        # (TVM heap-allocates buffers over 1 KB, which LLVM must assume alias).
                        for half in T.serial(BLOCK // HALF):
                            for j in T.unroll(HALF):
                                for r in T.vectorized(QT):
                                    dots[j, r] = T.float32(0)
                            for c in T.serial(d):
                                for j in T.unroll(HALF):
                                    for r in T.vectorized(QT):
                                        dots[j, r] = dots[j, r] + T.Cast("float32", k[
                                            kv_first + T.min(blk * BLOCK + half * HALF + j, kv_len - 1), h // group, c]) * qt[c, r]
                            for j in T.unroll(HALF):
                                if scaled:
                                    # int8 keys: the key's scale, once per score.
                                    for r in T.vectorized(QT):
                                        dots[j, r] = dots[j, r] * k_words[
                                            kv_first + T.min(blk * BLOCK + half * HALF + j, kv_len - 1), h // group, w - 1]
                                for r in T.vectorized(QT):
                                    st[half * HALF + j, r] = T.if_then_else(
                                        blk * BLOCK + half * HALF + j < limit[r], dots[j, r], T.float32(NEG))
                        # Per query: the block's max, one rescale, the weights and their sum.
                        for r in T.vectorized(QT):
                            alpha[r] = m[r]
                        for j in T.serial(BLOCK):
                            for r in T.vectorized(QT):
                                m[r] = T.max(m[r], st[j, r])
                        for r in T.vectorized(QT):
                            alpha[r] = _exp2_poly(alpha[r] - m[r])
                            total[r] = total[r] * alpha[r]
                        for j in T.serial(BLOCK):
                            for r in T.vectorized(QT):
                                st[j, r] = _exp2_poly(st[j, r] - m[r])
                                total[r] = total[r] + st[j, r]
                        if scaled:
                            # int8 values: each weight takes its value row's scale (after the
                            # sums above, which the softmax needs unscaled).
                            for j in T.serial(BLOCK):
                                for r in T.vectorized(QT):
                                    st[j, r] = st[j, r] * v_words[
                                        kv_first + T.min(blk * BLOCK + j, kv_len - 1), h // group, w - 1]
                        for r in T.serial(rows):
                            for c in T.vectorized(d):  # the row in a stack buffer (see dots)
                                row[c] = acc[r, c] * alpha[r]
                            for j in T.serial(T.min(limit[r] - blk * BLOCK, BLOCK)):
                                for c in T.vectorized(d):
                                    row[c] = row[c] + st[j, r] * T.Cast(
                                        "float32", v[kv_first + blk * BLOCK + j, h // group, c])
                            for c in T.vectorized(d):
                                acc[r, c] = row[c]
                    for r in T.serial(rows):
                        token: T.let[T.int32] = q_indptr[b] + row0 + r
                        inv: T.let[T.float32] = T.if_then_else(total[r] > T.float32(0), T.float32(1) / total[r],
                                                               T.float32(0))
                        for c in T.vectorized(d):
                            output[token, h, c] = acc[r, c] * inv
                        for s in T.serial(q_split):
                            lse[token, h * q_split + s] = T.if_then_else(total[r] > T.float32(0),
                                                                         m[r] + T.log2(total[r]), T.float32(NEG))

    return batch_prefill_ragged_kv


def split_qkv(layout: KVLayout):
    """The cache's ``tir_split_rotary`` slot: qkv [T, Hq' + 2 Hkv, words] -> q, k, v, as
    32-bit integer copies (the words may hold float16 / int8 payloads and scales, which a
    float copy need not preserve bit for bit). Kiln's graphs rotate q and k themselves, so
    ``apply_rope`` is always 0 here."""
    w, hq_c, h_kv = layout.words, layout.cache_q_heads, layout.num_kv_heads
    fused = hq_c + 2 * h_kv

    @T.prim_func(s_tir=True)
    def split_qkv_words(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle, var_k: T.handle,
                        var_v: T.handle, apply_rope: T.int64):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "global_symbol": "kiln_split_qkv_words"})
        seq_len = T.int32()
        position_map_elem_offset = T.int32()
        qkv_f = T.match_buffer(var_qkv, (seq_len, fused, w), "float32")
        q_f = T.match_buffer(var_q, (seq_len, hq_c, w), "float32")
        k_f = T.match_buffer(var_k, (seq_len, h_kv, w), "float32")
        v_f = T.match_buffer(var_v, (seq_len, h_kv, w), "float32")
        position_map = T.match_buffer(var_position_map, (seq_len,), "int32", elem_offset=position_map_elem_offset)
        qkv = T.decl_buffer((seq_len, fused * w), "int32", data=qkv_f.data)
        q = T.decl_buffer((seq_len, hq_c * w), "int32", data=q_f.data)
        k = T.decl_buffer((seq_len, h_kv * w), "int32", data=k_f.data)
        v = T.decl_buffer((seq_len, h_kv * w), "int32", data=v_f.data)
        for s in T.serial(seq_len):
            for i in T.vectorized(hq_c * w):
                q[s, i] = qkv[s, i]
            for i in T.vectorized(h_kv * w):
                k[s, i] = qkv[s, hq_c * w + i]
            for i in T.vectorized(h_kv * w):
                v[s, i] = qkv[s, (hq_c + h_kv) * w + i]

    return split_qkv_words
