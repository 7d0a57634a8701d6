"""The artifact's KV-cache factory: a Relax function ``create_kv_cache`` that builds TVM's
paged KV cache (``tvm.relax.frontend.nn.llm.kv_cache``: the runtime object plus its TIR
page and attention kernels for this target) for the model's geometry.

    create_kv_cache(R.Shape([max_batch_size, max_total_seq_len, prefill_chunk_size,
                             page_size, support_sliding_window])) -> Object

The runtime calls it by name with sizes chosen at load time; Kiln's own interfaces never
see TVM's positional constructor. RoPE is applied by the graph, so the cache applies none.
On CPU targets the cache's decode, paged-prefill and ragged-prefill attention kernels are
Kiln's (``kernels/cpu_attention.py``: same signatures, multi-core and vectorized) instead
of TVM's single-threaded ones.

The cache is declared over float32 words in ``KVLayout``'s geometry (query heads split in
``q_split`` word rows, ``words`` per head row), whatever the KV dtype: the page tensors
hold ``words`` per (token, KV head), and only Kiln's kernels know what the words hold.
"""

from __future__ import annotations

from tvm import relax, tirx

from kiln.runtime.kv_layout import KVLayout
from kiln.runtime.model_config import ModelConfig

FACTORY = "create_kv_cache"
CACHE_ARGS = ("max_batch_size", "max_total_seq_len", "prefill_chunk_size", "page_size", "support_sliding_window")
PAGE_SIZE = 16  # TVM's CPU attention kernels are specialized to 16-token pages


def add_kv_cache_factory(bb: relax.BlockBuilder, config: ModelConfig, target, layout: KVLayout) -> None:
    from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

    if layout.dtype != "float32" and target.kind.name != "llvm":
        raise ValueError(f"kv_dtype {layout.dtype}: packed KV caches are read by Kiln's CPU kernels only; "
                         f"{target.kind.name} artifacts keep float32 KV for now")

    sizes = [tirx.Var(name, "int64") for name in CACHE_ARGS]
    arg = relax.Var("cache_config", relax.ShapeType(sizes))
    with bb.function(FACTORY, [arg]):
        cache = TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=sizes[0],
            max_total_seq_len=sizes[1],
            prefill_chunk_size=sizes[2],
            page_size=sizes[3],
            support_sliding_window=sizes[4],
            layer_partition=relax.ShapeExpr([0, config.num_layers]),
            num_hidden_layers=config.num_layers,
            num_attention_heads=layout.cache_q_heads,
            num_key_value_heads=config.num_kv_heads,
            qk_head_dim=layout.words,
            v_head_dim=layout.words,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NONE,
            rope_scale=1,
            rope_theta=config.rope_theta,
            rope_scaling={},
            rope_ext_factors=relax.prim_value(0),
            rotary_dim=layout.words,
            enable_disaggregation=False,
            dtype="float32",
            target=target,
        )
        bb.emit_func_output(cache._expr)  # noqa: SLF001


def use_kiln_cpu_attention(mod, layout: KVLayout):
    """Put Kiln's CPU attention kernels (and its bitwise q/k/v split) in the cache's slots
    (the GlobalVar names TIRPagedKVCache gives them)."""
    from .kernels import cpu_attention as ka

    kernels = {
        "tir_attention_decode_cpu": ka.decode_paged(layout, PAGE_SIZE),
        "tir_attention_prefill_cpu": ka.prefill_paged(layout, PAGE_SIZE),
        "tir_attention_prefill_ragged_cpu": ka.prefill_ragged(layout),
        "tir_split_rotary": ka.split_qkv(layout),
    }
    for name, func in kernels.items():
        gv = mod.get_global_var(name)
        mod.update_func(gv, func)
    return mod
