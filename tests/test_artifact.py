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


@pytest.mark.parametrize("variant", ["llama", "qwen2", "llama3"])
def test_tvm_logits_match_torch_on_prefill_and_decode_steps(checkpoint, compiled, variant):
    module = resolve_model(checkpoint(variant)).build_module()
    engine = Engine.load(compiled(variant))
    ex = engine._executor
    rng = np.random.default_rng()
    b, s = int(rng.integers(1, 4)), int(rng.integers(1, 20))
    ids = rng.integers(0, module.config.vocab_size, (b, s)).astype(np.int64)
    pos = np.broadcast_to(np.arange(s), (b, s)).astype(np.int64).copy()
    with torch.no_grad():
        ref, past = module(torch.from_numpy(ids), torch.from_numpy(pos))
    logits, kv = ex.prefill(ids, pos)
    assert np.abs(logits - ref.numpy()).max() <= 1e-4
    np.testing.assert_allclose(kv.tensors[0].numpy(), past[0][0].numpy(), atol=1e-5)
    for step in range(5):
        tok = rng.integers(0, module.config.vocab_size, (b, 1)).astype(np.int64)
        p = np.full((b, 1), s + step, dtype=np.int64)
        with torch.no_grad():
            ref, past = module(torch.from_numpy(tok), torch.from_numpy(p), past)
        logits, kv = ex.decode(tok, p, kv)
        assert np.abs(logits - ref.numpy()).max() <= 1e-4
    assert kv.tensors[-1].numpy().shape == (b, module.config.num_kv_heads, s + 5, module.config.head_dim)


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
    assert set(m.functions) == {"prefill", "decode"}
    assert m.functions["decode"].inputs[:4] == ("input_ids", "position_ids", "past.0.key", "past.0.value")
    assert set(m.files) == {"model.so", "params.bin", "tokenizer.json", "tokenizer_config.json"}
    assert m.kv_cache["num_layers"] == m.model.num_layers and m.quantization == "fp32"
    # Every checkpoint weight is stored once, in float32, with its shape and name.
    module = resolve_model(checkpoint("qwen2")).build_module()
    state = {k: v for k, v in module.state_dict().items()}
    arrays = dict(zip((p.name for p in m.params), read_params(folder, m)))
    for name, tensor in state.items():
        np.testing.assert_array_equal(arrays[name], tensor.numpy())
        assert arrays[name].dtype == np.float32
    assert len({p.name for p in m.params}) == len(m.params)


def test_inspect_prints_the_manifest(compiled):
    from click.testing import CliRunner

    from kiln.cli.main import cli
    import kiln.cli.runtime_cmds  # noqa: F401

    result = CliRunner().invoke(cli, ["inspect", str(compiled("llama"))])
    assert result.exit_code == 0, result.output
    assert "llama" in result.output and "llvm" in result.output and "prefill, decode" in result.output
    result = CliRunner().invoke(cli, ["inspect", str(compiled("llama")), "--json"])
    assert json.loads(result.output)["schema_version"] == 1
