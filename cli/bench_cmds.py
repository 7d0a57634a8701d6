"""``kiln bench``: a thin shell over kiln.bench.sweep (needs the compiler extras)."""

from __future__ import annotations

from pathlib import Path

import click

from .main import cli, handle_errors


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@cli.command("bench")
@click.argument("artifacts", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--batch", "batches", default="1,4,16", show_default=True, help="batch sizes, comma-separated")
@click.option("--prompt-len", type=int, default=128, show_default=True, help="tokens per prompt")
@click.option("--decode-steps", type=int, default=16, show_default=True, help="batched decode steps timed")
@click.option("--repeats", type=int, default=3, show_default=True, help="timed runs per figure (median)")
@click.option("--systems", default="kiln,onnxruntime,torch", show_default=True,
              help="any of kiln, onnxruntime, torch")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench/out"),
              show_default=True, help="where bench.json and bench.png go")
@handle_errors
def bench_command(artifacts, batches, prompt_len, decode_steps, repeats, systems, out):
    """Prefill / decode tokens/s, resident memory and weight size of each ARTIFACT (e.g.
    one per quantization scheme) at each batch size, next to onnxruntime on the same
    quantized ONNX and torch eager, with the batch-1 decode roofline of this machine."""
    import kiln.compiler  # noqa: F401  (the full TVM first: ONNX export needs the compiler)
    from kiln.bench.sweep import BenchConfig, format_report, run_sweep, write_outputs

    config = BenchConfig(_ints(batches), prompt_len, decode_steps, repeats,
                         tuple(s.strip() for s in systems.split(",") if s.strip()))
    report = run_sweep(list(artifacts), config, progress=lambda m: click.echo(m, err=True))
    click.echo(format_report(report))
    for path in write_outputs(report, out):
        click.echo(f"wrote {path}", err=True)
