"""Compile tiny checkpoints to llvm artifacts; the artifact's logits and greedy tokens
match torch; the manifest describes the artifact."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import torch_greedy
from kiln.compiler.models.source import resolve_model
from kiln.runtime.artifact import load_manifest, read_params
from kiln.runtime.engine import Engine


def _cache(ex, batch=4, tokens=512, chunk=256):
    from kiln.runtime.executor import CacheConfig

    return ex.create_cache(CacheConfig(max_batch_size=batch, max_total_tokens=tokens, prefill_chunk_size=chunk,
                                       page_size=ex.page_size))


@pytest.mark.parametrize("variant", ["llama", "qwen2", "llama3"])
def test_ragged_prefill_and_batched_decode_match_torch(checkpoint, compiled, variant):
    """Sequences of different lengths in one ragged prefill, then batched decode steps:
    each sequence's logits and cached KV equal torch running it alone."""
    from kiln.runtime.executor import Chunk

    module = resolve_model(checkpoint(variant)).build_module()
    ex = Engine.load(compiled(variant))._executor
    cache = _cache(ex)
    rng = np.random.default_rng()
    lengths = [int(n) for n in rng.integers(1, 30, 3)]
    seqs = {i: rng.integers(0, module.config.vocab_size, n).tolist() for i, n in enumerate(lengths)}
    for i in seqs:
        cache.add(i)
    logits = ex.forward(cache, [Chunk(i, tuple(t), 0) for i, t in seqs.items()])
    for step in range(4):
        for i, toks in seqs.items():
            with torch.no_grad():
                ref, past = module(torch.tensor([toks]), torch.arange(len(toks))[None])
            assert np.abs(logits[i] - ref.numpy()[0]).max() <= 1e-4
        k, v = cache.read_kv(0, len(seqs[0]), module.config)
        with torch.no_grad():
            _, past = module(torch.tensor([seqs[0]]), torch.arange(len(seqs[0]))[None])
        np.testing.assert_allclose(k[0].transpose(1, 0, 2), past[0][0].numpy()[0], atol=1e-5)
        np.testing.assert_allclose(v[-1].transpose(1, 0, 2), past[-1][1].numpy()[0], atol=1e-5)
        nxt = {i: int(rng.integers(0, module.config.vocab_size)) for i in seqs}
        logits = ex.forward(cache, [Chunk(i, (nxt[i],), len(t)) for i, t in seqs.items()])
        for i in seqs:
            seqs[i].append(nxt[i])


def test_fork_shares_the_prefix_and_chunks_continue_it(checkpoint, compiled):
    """A fork at any position (page-aligned or not), then chunked continuation, gives the
    same logits as computing the whole sequence at once."""
    from kiln.runtime.executor import Chunk

    module = resolve_model(checkpoint("llama")).build_module()
    ex = Engine.load(compiled("llama"))._executor
    cache = _cache(ex)
    rng = np.random.default_rng()
    parent = rng.integers(0, module.config.vocab_size, 40).tolist()
    cache.add(0)
    ex.forward(cache, [Chunk(0, tuple(parent[:25]), 0, ())])  # a prefill chunk without logits
    ex.forward(cache, [Chunk(0, tuple(parent[25:]), 25)])
    free_before = cache.available_pages()
    cache.fork(0, 1, 32)  # page-aligned: shares two pages, takes none
    assert cache.available_pages() == free_before
    cache.fork(0, 2, 21)  # inside a page: the partial page is copied
    assert cache.available_pages() == free_before - 1
    tails = {1: rng.integers(0, module.config.vocab_size, 9).tolist(), 2: rng.integers(0, module.config.vocab_size, 5).tolist()}
    out = ex.forward(cache, [Chunk(1, tuple(tails[1]), 32), Chunk(2, tuple(tails[2]), 21)])
    for row, (sid, pos) in enumerate(((1, 32), (2, 21))):
        full = parent[:pos] + tails[sid]
        with torch.no_grad():
            ref, _ = module(torch.tensor([full]), torch.arange(len(full))[None])
        assert np.abs(out[row] - ref.numpy()[0]).max() <= 1e-4
    for sid in (0, 1, 2):
        cache.remove(sid)
    assert cache.available_pages() == cache.total_pages


def test_greedy_generation_matches_torch(checkpoint, compiled):
    module = resolve_model(checkpoint("llama")).build_module()
    engine = Engine.load(compiled("llama"))
    prompt = "The quick brown fox"
    expected = torch_greedy(module, engine.tokenizer.encode(prompt), 24)
    out = engine.generate(prompt, max_tokens=24, ignore_eos=True)
    assert list(out.token_ids) == expected
    assert out.finish_reason == "length" and out.completion_tokens == 24
    assert out.text == engine.tokenizer.decode(expected)


def test_manifest_describes_the_artifact(checkpoint, compiled):
    folder = compiled("qwen2")
    m = load_manifest(folder)
    raw = json.loads((folder / "manifest.json").read_text())
    assert raw["schema_version"] == 1 and raw["kiln_version"] and raw["tvm_version"].startswith("0.27")
    assert m.model.architecture == "qwen2" and m.model.qkv_bias
    assert m.target.kind == "llvm" and m.target.device == "cpu" and m.target.mcpu
    # decode_b1: decode at a static batch of 1 (the tuned bucket), called for one sequence;
    # prefill_t128: prefill of exactly 128 tokens (the tiny model's whole context).
    assert set(m.functions) == {"create_kv_cache", "prefill", "decode", "decode_b1", "prefill_t128"}
    assert m.functions["decode_b1"] == m.functions["decode"] and m.dispatch.static_decode == (1,)
    assert m.functions["prefill_t128"] == m.functions["prefill"] and m.dispatch.static_prefill == (128,)
    assert m.functions["prefill"].inputs == ("input_ids", "position_ids", "logit_positions", "kv_cache")
    assert m.functions["decode"].inputs == ("input_ids", "position_ids", "kv_cache")
    assert m.kv_cache["layout"] == "paged" and m.kv_cache["page_size"] == 16
    assert set(m.files) == {"model.so", "params.bin", "tokenizer.json", "tokenizer_config.json"}
    assert m.kv_cache["num_layers"] == m.model.num_layers and m.quantization == "fp32"
    assert m.dispatch.decode_max_batch is None  # float32 weights: decode runs every batch
    # Every checkpoint weight is stored once, in float32, under its name: vectors as they
    # are, matrices (projections, embedding, LM head; N a multiple of 32 here) as K-major
    # panels [N / 32, K, 32] with W[n, k] at [n // 32, k, n % 32] (lower/quant_weights.py).
    module = resolve_model(checkpoint("qwen2")).build_module()
    state = {k: v for k, v in module.state_dict().items()}
    arrays = dict(zip((p.name for p in m.params), read_params(folder, m)))
    for name, tensor in state.items():
        want, got = tensor.numpy(), arrays[name]
        if want.ndim == 2:
            n, k = want.shape
            assert got.shape == (n // 32, k, 32), name
            got = got.transpose(0, 2, 1).reshape(n, k)
        np.testing.assert_array_equal(got, want)
        assert arrays[name].dtype == np.float32
    assert len({p.name for p in m.params}) == len(m.params)


def test_cuda_artifact_keeps_float_weights_row_major(checkpoint, compiled):
    """Panels are the CPU kernels' layout; a CUDA artifact stores W [N, K] as it is."""
    m = load_manifest(compiled("llama", "cuda:sm_90"))
    state = resolve_model(checkpoint("llama")).build_module().state_dict()
    shapes = {p.name: tuple(p.shape) for p in m.params}
    assert all(shapes[name] == tuple(t.shape) for name, t in state.items())


def test_inspect_prints_the_manifest(compiled):
    from click.testing import CliRunner

    from kiln.cli.main import cli
    import kiln.cli.runtime_cmds  # noqa: F401

    result = CliRunner().invoke(cli, ["inspect", str(compiled("llama"))])
    assert result.exit_code == 0, result.output
    assert "llama" in result.output and "llvm" in result.output and "prefill, decode" in result.output
    assert "decode_b1 (static shapes) for 1" in result.output and "static pieces (prefill_t128)" in result.output
    result = CliRunner().invoke(cli, ["inspect", str(compiled("llama")), "--json"])
    assert json.loads(result.output)["schema_version"] == 1
