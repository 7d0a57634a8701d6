"""Kiln's CPU attention kernels for TVM's paged KV cache.

They have exactly the signatures (and the log2-based softmax-state convention) of TVM's
``_attention_decode_cpu`` / ``_attention_prefill_cpu`` / ``_attention_prefill_ragged_cpu``,
so the cache calls them in their place; those are single-threaded scalar loops. These
split the work over cores by (token, query head) and vectorize over the head dim:

* keys are visited a block (one page, or 16 ragged rows) at a time: the block's scores,
  their max, one rescale of the running output, then the weighted value rows (online
  softmax per block); a block is a [rows, d] view of the page or of the ragged K / V;
* dot products accumulate VEC lanes at a time, then sum the lanes.

Softmax state: scores s = q.k * sm_scale * log2(e); lse = m + log2(sum exp2(s - m)), so the
cache can merge partial results (prefix blocks, ragged + paged parts) as TVM's do.
Rotary embedding is never applied here (Kiln's graphs rotate q and k themselves), and
sliding windows are not supported (TVM's kernels remain in those slots).
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

LOG2E = math.log2(math.exp(1))
LN2 = math.log(2)
NEG = -5e4
VEC = 16
BLOCK = 16  # keys per block in the ragged kernel


def _core(d: int, dtype: str, block: int):
    """The online-softmax steps every kernel shares, as TVMScript macros. Per task:
    acc [d] running output, lane [VEC] dot-product lanes, scores and weights [block],
    state [3] = (running max m, running sum, block max)."""
    lanes = VEC if d % VEC == 0 else 1

    @T.macro
    def start(acc: T.Buffer, state: T.Buffer):
        state[0] = T.float32(NEG)
        state[1] = T.float32(0)
        for i in T.vectorized(d):
            acc[i] = T.float32(0)

    @T.macro
    def attend(acc: T.Buffer, lane: T.Buffer, scores: T.Buffer, weights: T.Buffer, state: T.Buffer, q: T.Buffer,
               row: T.int32, h: T.int32, keys: T.Buffer, values: T.Buffer, rows: T.int32, sm_scale: T.float32):
        # keys, values: [block, d] views; q[row, h, :] is the query.
        state[2] = T.float32(NEG)
        for j in T.serial(rows):
            for l in T.vectorized(lanes):
                lane[l] = T.float32(0)
            for c in T.serial(d // lanes):
                for l in T.vectorized(lanes):
                    lane[l] = lane[l] + T.Cast("float32", q[row, h, c * lanes + l]) * T.Cast(
                        "float32", keys[j, c * lanes + l])
            # Sum the lanes by halving vector adds (a serial scalar sum of 16 lanes cost
            # more than the dot product itself). With lanes = 1 the loops are empty.
            for l in T.vectorized(lanes // 2):
                lane[l] = lane[l] + lane[l + lanes // 2]
            for l in T.vectorized(lanes // 4):
                lane[l] = lane[l] + lane[l + lanes // 4]
            for l in T.vectorized(lanes // 8):
                lane[l] = lane[l] + lane[l + lanes // 8]
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
            # 2^x = 2^n * 2^f, n = round(x), f in [-1/2, 1/2]: degree-6 Taylor series of
            # e^(f ln 2) (relative error ~1e-7), 2^n built in the exponent bits. The exp2
            # intrinsic would be one scalar libm call per key (no vector math library).
            x: T.let[T.float32] = T.max(scores[j] - state[0], T.float32(-126))
            n: T.let[T.float32] = T.floor(x + T.float32(0.5))
            f: T.let[T.float32] = (x - n) * T.float32(LN2)
            weights[j] = (T.float32(1) + f * (T.float32(1) + f * (T.float32(1 / 2) + f * (T.float32(1 / 6) + f * (
                T.float32(1 / 24) + f * (T.float32(1 / 120) + f * T.float32(1 / 720))))))) * T.reinterpret(
                "float32", T.shift_left(T.Cast("int32", n) + 127, 23))
        for j in T.serial(rows):
            state[1] = state[1] + weights[j]
            for i in T.vectorized(d):
                acc[i] = acc[i] + weights[j] * T.Cast("float32", values[j, i])

    @T.macro
    def finish(acc: T.Buffer, state: T.Buffer, output: T.Buffer, lse: T.Buffer, row: T.int32, h: T.int32):
        inv: T.let[T.float32] = T.if_then_else(state[1] > T.float32(0), T.float32(1) / state[1], T.float32(0))
        for i in T.vectorized(d):
            output[row, h, i] = T.Cast(dtype, acc[i] * inv)
        lse[row, h] = T.if_then_else(state[1] > T.float32(0), state[0] + T.log2(state[1]), T.float32(NEG))

    return lanes, start, attend, finish


def decode_paged(h_kv: int, h_q: int, d: int, dtype: str, page_size: int = 16):
    group = h_q // h_kv
    lanes, start, attend, finish = _core(d, dtype, page_size)

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
        Q = T.match_buffer(Q_handle, (B, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32",
                                           elem_offset=page_indptr_elem_offset)
        page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32",
                                           elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (B, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (B, h_q), "float32")
        last_page_len = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_info_elem_offset)

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
                    keys = T.decl_buffer((page_size, d), dtype, data=pages.data,
                                         elem_offset=((page * 2) * h_kv + h // group) * page_size * d)
                    values = T.decl_buffer((page_size, d), dtype, data=pages.data,
                                           elem_offset=((page * 2 + 1) * h_kv + h // group) * page_size * d)
                    attend(acc, lane, scores, weights, state, Q, b, h, keys, values,
                           T.if_then_else(p == num_pages - 1, last_page_len[b], page_size), sm_scale)
                finish(acc, state, output, lse, b, h)

    return batch_decode_paged_kv


def prefill_paged(h_kv: int, h_q: int, d: int, dtype: str, page_size: int = 16):
    group = h_q // h_kv
    lanes, start, attend, finish = _core(d, dtype, page_size)

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
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        last_page_len = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_info_elem_offset)

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
                        keys = T.decl_buffer((page_size, d), dtype, data=pages.data,
                                             elem_offset=((page * 2) * h_kv + h // group) * page_size * d)
                        values = T.decl_buffer((page_size, d), dtype, data=pages.data,
                                               elem_offset=((page * 2 + 1) * h_kv + h // group) * page_size * d)
                        attend(acc, lane, scores, weights, state, q, token, h, keys, values,
                               T.min(visible - p * page_size, page_size), sm_scale)
                    finish(acc, state, output, lse, token, h)

    return batch_prefill_paged_kv_cpu


def prefill_ragged(h_kv: int, h_q: int, d_qk: int, d_v: int, dtype: str):
    if d_qk != d_v:
        raise ValueError("Kiln's ragged CPU kernel needs equal q/k and v head dims")
    d = d_qk
    group = h_q // h_kv
    lanes, start, attend, finish = _core(d, dtype, BLOCK)

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
        q = T.match_buffer(var_q, (qo_len_total, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len_total, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_len_total, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len_total,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_len_total, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len_total, h_q), "float32")

        for b in T.serial(batch_size):
            for th in T.parallel((q_indptr[b + 1] - q_indptr[b]) * h_q):
                with T.sblock("attn"):
                    T.reads()  # opaque: the regions depend on the index tables read inside
                    T.writes()
                    acc = T.sblock_alloc_buffer((d,), "float32")
                    lane = T.sblock_alloc_buffer((lanes,), "float32")
                    scores = T.sblock_alloc_buffer((BLOCK,), "float32")
                    weights = T.sblock_alloc_buffer((BLOCK,), "float32")
                    state = T.sblock_alloc_buffer((3,), "float32")
                    h: T.let[T.int32] = th % h_q
                    token: T.let[T.int32] = q_indptr[b] + th // h_q
                    kv_first: T.let[T.int32] = kv_indptr[b]
                    kv_len: T.let[T.int32] = kv_indptr[b + 1] - kv_first
                    visible: T.let[T.int32] = T.if_then_else(
                        causal > 0, T.min(kv_len - (q_indptr[b + 1] - q_indptr[b]) + th // h_q + 1, kv_len), kv_len)
                    start(acc, state)
                    for blk in T.serial((visible + BLOCK - 1) // BLOCK):
                        # Rows of one KV head in the ragged [tokens, h_kv, d] layout: stride h_kv * d.
                        keys = T.decl_buffer((BLOCK, d), dtype, data=k.data, strides=(h_kv * d, 1),
                                             elem_offset=((kv_first + blk * BLOCK) * h_kv + h // group) * d)
                        values = T.decl_buffer((BLOCK, d), dtype, data=v.data, strides=(h_kv * d, 1),
                                               elem_offset=((kv_first + blk * BLOCK) * h_kv + h // group) * d)
                        attend(acc, lane, scores, weights, state, q, token, h, keys, values,
                               T.min(visible - blk * BLOCK, BLOCK), sm_scale)
                    finish(acc, state, output, lse, token, h)

    return batch_prefill_ragged_kv
