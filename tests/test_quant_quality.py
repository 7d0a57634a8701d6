"""Quality gate of quantization on the default model (SmolLM2-135M-Instruct):
teacher-forced perplexity on a fixed text shipped with the tests, and top-1 agreement with
the float32 artifact, position by position.

The issues' targets (TARGETS): int8 perplexity within 1% of float32 and agreement >= 97%;
int4-g32 within 6% and >= 90%; int8 activations (w8a8, w4a8) within 1% and >= 97%.
Measured (perplexity change / agreement over 525 tokens): int8 -0.01% / 97.7%, int4-g32
+0.00% / 100%, w8a8 +0.14% / 97.7%, w4a8 +0.15% / 98.5%; over the 2,047 tokens of
long_quality_text.txt w8a8 +0.21% / 97.2% and w4a8 +0.15% / 98.1%. The model's float32
weights are a dequantized GGUF (Q4_1 projections, Q8_0 token table), which Kiln's
asymmetric int4 blocks and int8 tables reproduce; the earlier symmetric int4 scheme
measured +36% / 62%, per-channel int8 +0.55% / 96.0%, int4-g128 +61% / 66.7% (it folds
four 4-bit blocks into one), and int8 activations in blocks of 32 96.4% (one outlier
flattens its block). Which near-ties flip is sensitive: w8a8 with float32 KV and
512-token chunks measured 96.6% here. The test gates on GATES, a little below what is
measured, so a regression fails, and warns when a target is missed."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from kiln.runtime.engine import Engine
from kiln.runtime.quality import perplexity, teacher_forced_logits, top1_agreement

TEXT = (Path(__file__).parent / "data" / "quality_text.txt").read_text()

# (max perplexity increase, min agreement); w8a8: int8 weights and int8 activations (issue 14).
TARGETS = {"int8": (0.01, 0.97), "int4-g32": (0.06, 0.90), "w8a8": (0.01, 0.97), "w4a8": (0.01, 0.97)}
# int4-g128 (no target; +61% / 66.7% when last gated) is no longer compiled here: the suite's
# time goes to the schemes Kiln recommends.
GATES = {"int8": (0.005, 0.965), "int4-g32": (0.01, 0.98), "w8a8": (0.005, 0.96), "w4a8": (0.005, 0.97)}


@pytest.fixture(scope="module")
def reference(smollm2_artifact):
    engine = Engine.load(smollm2_artifact, background=False)
    ids = engine.tokenizer.encode(TEXT)
    return ids, teacher_forced_logits(engine, ids)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", list(GATES))
def test_quantized_default_model_keeps_its_quality(tmp_path, smollm2_graphs, reference, scheme):
    from kiln.compiler.compile import CompileOptions, compile_graphs
    from kiln.compiler.passes.pipeline import run_passes
    from kiln.runtime.quantization import parse_quant
    from kiln.compiler.targets import parse_target

    source, fresh_graphs = smollm2_graphs
    options = CompileOptions(parse_target("llvm"), quant=parse_quant(scheme))
    folder = compile_graphs(source, run_passes(fresh_graphs(), quant=options.quant), tmp_path / scheme, options)
    engine = Engine.load(folder, background=False)
    ids, ref_logits = reference
    logits = teacher_forced_logits(engine, ids)
    ppl, ref_ppl = perplexity(logits, ids), perplexity(ref_logits, ids)
    agree = top1_agreement(logits, ref_logits)
    max_ppl_increase, min_agreement = GATES[scheme]
    print(f"{scheme}: perplexity {ppl:.3f} vs {ref_ppl:.3f} float32 ({ppl / ref_ppl - 1:+.2%}), "
          f"top-1 agreement {agree:.1%} over {len(ids) - 1} tokens")
    assert len(ids) > 400
    target_ppl, target_agree = TARGETS.get(scheme, (float("inf"), 0.0))
    if ppl > ref_ppl * (1 + target_ppl) or agree < target_agree:
        warnings.warn(f"{scheme} misses the quality target (perplexity +{target_ppl:.0%}, agreement "
                      f">= {target_agree:.0%}): {ppl / ref_ppl - 1:+.2%}, {agree:.1%}", stacklevel=1)
    assert ppl <= ref_ppl * (1 + max_ppl_increase)
    assert agree >= min_agreement
