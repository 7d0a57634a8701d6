"""Quality gate of weight-only quantization on the default model (SmolLM2-135M-Instruct):
teacher-forced perplexity on a fixed text shipped with the tests, and top-1 agreement with
the float32 artifact, position by position.

Targets: int8 perplexity within 1% of float32 and agreement >= 97%; int4-g32 within 6%
and >= 90%."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.runtime.engine import Engine
from kiln.runtime.quality import perplexity, teacher_forced_logits, top1_agreement

TEXT = (Path(__file__).parent / "data" / "quality_text.txt").read_text()

TARGETS = {"int8": (0.01, 0.97), "int4-g32": (0.06, 0.90)}


@pytest.fixture(scope="module")
def reference(smollm2_artifact):
    engine = Engine.load(smollm2_artifact, background=False)
    ids = engine.tokenizer.encode(TEXT)
    return ids, teacher_forced_logits(engine, ids)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", list(TARGETS))
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
    max_ppl_increase, min_agreement = TARGETS[scheme]
    print(f"{scheme}: perplexity {ppl:.3f} vs {ref_ppl:.3f} float32 ({ppl / ref_ppl - 1:+.2%}), "
          f"top-1 agreement {agree:.1%} over {len(ids) - 1} tokens")
    assert len(ids) > 400
    assert ppl <= ref_ppl * (1 + max_ppl_increase)
    assert agree >= min_agreement
