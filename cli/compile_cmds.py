"""``kiln compile`` and ``kiln verify`` (need the compiler extras: torch, onnx, ...)."""

from __future__ import annotations

from pathlib import Path

import click

from .main import cli, handle_errors

# The scheme registry is plain Python (no torch): safe to import for the CLI's choices.
from kiln.runtime.kv_layout import KV_DTYPES  # noqa: E402
from kiln.runtime.quantization import ACTIVATIONS, CHOICES, parse_quant  # noqa: E402

TARGET_HELP = "llvm (this CPU), llvm:<mcpu>, cuda (sm_90) or cuda:sm_80|sm_86|sm_89|sm_90"


@cli.command("compile")
@click.argument("model")
@click.option("--target", "target", default="llvm", show_default=True, help=TARGET_HELP)
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="artifact folder [default: artifacts/<model>-<target>]")
@click.option("--context-length", type=int, default=None,
              help="longest sequence served (prompt + output) [default: the model's, capped at 8192]")
@click.option("--dump-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="write each compiler phase's ONNX graphs here")
@click.option("--quant", type=click.Choice(list(CHOICES)), default="fp32", show_default=True,
              help="weight storage: int8 per block of 32, int4 (asymmetric) per block of 32/64/128 "
                   "with int8 embedding / LM head, or fp16; w8a8 / w4a8: int8 / int4-g32 weights with int8 activations")
@click.option("--act", "activations", type=click.Choice(list(ACTIVATIONS)), default=None,
              help="activations into int8-weight matmuls: int8 (per row and block of 16, integer dot "
                   "products; CPUs with AVX-512 VNNI or AVX2) or float32 (weight-only) [default: int8 for "
                   "int8 and int4 weights where the target has either, else float32]")
@click.option("--quant-embedding/--no-quant-embedding", default=True, show_default=True,
              help="also quantize the token embedding table")
@click.option("--quant-lm-head/--no-quant-lm-head", default=True, show_default=True,
              help="also quantize the LM head")
@click.option("--kv-dtype", type=click.Choice(list(KV_DTYPES)), default=None,
              help="how the KV cache stores keys and values: float32, float16 (half the bytes), or int8 "
                   "with a float32 scale per token and head (27% of float32's bytes) "
                   "[default: float16 on CPU targets, float32 on CUDA]")
@click.option("--tuned/--untuned", default=True, show_default=True,
              help="apply the target's MetaSchedule database under schedules/ when there is one")
@handle_errors
def compile_command(model, target, out, context_length, dump_dir, quant, activations, quant_embedding, quant_lm_head,
                    kv_dtype, tuned):
    """Compile MODEL (an HF folder, a .gguf file, or 'default') into an artifact."""
    from kiln.compiler.compile import CompileOptions, compile_model, default_out_dir
    from kiln.compiler.targets import parse_target

    from kiln.compiler.compile import default_activations

    spec = parse_target(target)
    activations = activations or default_activations(quant, spec)
    options = CompileOptions(target=spec, context_length=context_length, dump_dir=dump_dir,
                             quant=parse_quant(quant, quant_embedding, quant_lm_head, activations), tuned=tuned,
                             kv_dtype=kv_dtype)
    out = out or default_out_dir(model, spec, options.quant, kv_dtype)
    path = compile_model(model, out, options, log=lambda m: click.echo(m, err=True))
    click.echo(str(path))


@cli.command("tune")
@click.argument("model")
@click.option("--target", "target", default="llvm", show_default=True, help=TARGET_HELP)
@click.option("--trials", type=int, default=64, show_default=True, help="MetaSchedule candidates measured per kernel")
@click.option("--quant", "quants", type=click.Choice(list(CHOICES)), multiple=True,
              help="tune the kernels of these weight schemes (repeatable) [default: fp32]")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="database folder [default: schedules/<target key>/]")
@click.option("--gate/--no-gate", default=True, show_default=True,
              help="keep records only if the static-bucket step, built and timed with and without them, "
                   "runs faster with them")
@handle_errors
def tune_command(model, target, trials, quants, out, gate):
    """Tune MODEL's static-shape kernels (the batch-1 decode bucket) with MetaSchedule into
    the target's database, which kiln compile then applies."""
    from kiln.compiler.targets import parse_target
    from kiln.compiler.tune.tuner import TuneOptions, tune_model

    options = TuneOptions(parse_target(target), trials=trials, out_dir=out, gate=gate)
    report = tune_model(model, [parse_quant(q) for q in (quants or ("fp32",))], options,
                        log=lambda m: click.echo(m, err=True))
    tuned = [r for r in report.tasks if r.tuned]
    click.echo(f"{len(report.tasks)} kernels; MetaSchedule beat the default schedule on {len(tuned)}"
               + (f": {', '.join(r.name for r in tuned)}" if tuned else ""))
    for scheme, result in (report.gates or {}).items():
        click.echo(f"{scheme}: {result.summary()}")
    if report.gates is None:
        click.echo("step gate skipped (--no-gate): the records are unchecked against the step")
    click.echo(f"database: {report.database} ({report.records} records)")


@cli.command("verify")
@click.argument("model")
@click.option("--context-length", type=int, default=None, help="as for kiln compile")
@click.option("--artifact", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="also compare this compiled artifact of MODEL against torch")
@click.option("--batch", type=int, default=2, show_default=True, help="batch size of the random inputs")
@click.option("--seq", type=int, default=7, show_default=True, help="prompt length of the random inputs")
@click.option("--seed", type=int, default=None, help="seed of the random inputs [default: fresh]")
@click.option("--tolerance", type=float, default=1e-3, show_default=True,
              help="max |difference| of logits and KV allowed")
@handle_errors
def verify_command(model, context_length, artifact, batch, seq, seed, tolerance):
    """Run MODEL's exported ONNX graphs in onnxruntime (and optionally an artifact) against
    the torch model on fresh random inputs; report the error per graph."""
    from kiln.compiler.verify import verify_model

    reports = verify_model(model, context_length=context_length, artifact=artifact, batch=batch,
                           seq=seq, seed=seed, log=lambda m: click.echo(m, err=True))
    click.echo(f"{'graph':<8} {'backend':<12} {'max|dlogits|':>13} {'max|dKV|':>11} {'rel':>9}")
    worst = 0.0
    for r in reports:
        click.echo(f"{r.graph:<8} {r.backend:<12} {r.logits_error:>13.2e} {r.kv_error:>11.2e} {r.relative_error:>9.2e}")
        worst = max(worst, r.logits_error, r.kv_error)
    if worst > tolerance:
        raise click.ClickException(f"max error {worst:.2e} exceeds the tolerance {tolerance:.1e}")
    click.echo(f"ok: every graph within {tolerance:.1e}")
