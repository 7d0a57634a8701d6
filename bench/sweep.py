"""``kiln bench``: quantization x batch size, Kiln next to onnxruntime and torch eager.

For every artifact (one per quantization scheme) and batch size B, each system runs B
random prompts of ``prompt_len`` tokens in one prefill call, then ``steps`` batched
decode steps, each configuration in its own worker process (worker.py), so the
resident memory reported is that system's own. Systems:

* kiln         the artifact, TVM runtime only
* onnxruntime  the same exported ONNX graphs with the same weight quantization
               (``DequantizeLinear`` -> ``MatMul``, which ORT fuses into its own kernels)
* ort proj-only  quantized artifacts whose embedding / LM head are quantized too: ORT
               has no fused kernel for a gather or GEMV of a dequantized table (it
               dequantizes the whole [V, H] table every step), so its best configuration
               of the scheme keeps those two float; for int4 also with integer zero
               points instead of float minima (ort_zero_point.py), the form ORT fuses
               into its 4-bit kernel; measured as well
* torch eager  Kiln's float32 torch model (torch has no such quantized graph): measured
               once per batch size and listed beside every scheme

Batch-1 decode is set against the roofline (roofline.py): measured read bandwidth over
the bytes a step must read. Every time is a median of ``repeats`` runs after a warm-up;
the machine is shared and noisy, so compare ratios within one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kiln.runtime.artifact import PARAMS_FILE, load_manifest
from kiln.runtime.quantization import QuantConfig, quant_from_record

from .roofline import bytes_per_token, read_bandwidth

SYSTEMS = ("kiln", "onnxruntime", "torch")


@dataclass(frozen=True)
class BenchConfig:
    batches: tuple[int, ...] = (1, 4, 16)
    prompt_len: int = 128
    steps: int = 16
    repeats: int = 3
    systems: tuple[str, ...] = SYSTEMS

    def __post_init__(self):
        if not self.batches or any(not isinstance(b, int) or b < 1 for b in self.batches):
            raise ValueError(f"batch sizes must be positive integers, got {self.batches!r}")
        for name in ("prompt_len", "steps", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"unknown systems {unknown or '(none)'}; choose from {', '.join(SYSTEMS)}")


@dataclass(frozen=True)
class Row:
    quant: str  # the artifact's scheme
    system: str
    batch: int
    prefill_tok_s: float
    decode_tok_s: float
    step_ms: float  # one decode step of the whole batch
    rss_peak_mb: float  # the worker process's peak resident memory
    model_mb: float  # peak resident memory above the framework's own (after its import)
    size_mb: float  # weights on disk: the artifact's params, the ONNX files, torch's float32 params


@dataclass(frozen=True)
class Roofline:
    quant: str
    bytes_per_token: int
    tok_s: float  # bandwidth / bytes_per_token


@dataclass(frozen=True)
class Report:
    config: BenchConfig
    bandwidth_gb_s: float
    rows: tuple[Row, ...]
    rooflines: tuple[Roofline, ...]

    def to_json(self) -> dict:
        return {"config": asdict(self.config), "bandwidth_gb_s": self.bandwidth_gb_s,
                "rows": [asdict(r) for r in self.rows], "rooflines": [asdict(r) for r in self.rooflines]}


def run_sweep(artifacts: list[Path], config: BenchConfig, progress=print) -> Report:
    manifests = [load_manifest(a) for a in artifacts]
    for path, m in zip(artifacts, manifests):
        if m.target.kind != "llvm":
            raise ValueError(f"{path}: kiln bench measures CPU (llvm) artifacts on this machine; "
                             f"this one targets {m.target.key}")
    progress("measuring memory bandwidth")
    bandwidth = read_bandwidth()
    context = config.prompt_len + config.steps // 2  # mean context of the decode steps
    per_token = [bytes_per_token(m, context) for m in manifests]
    rooflines = tuple(Roofline(m.quantization, n, bandwidth / n) for m, n in zip(manifests, per_token))
    rows: list[Row] = []
    modules: dict = {}  # (source, context) -> the torch model, built once for every export
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        for path, m in zip(artifacts, manifests):
            graphs = (_ort_graphs(m, modules, Path(tmp) / path.name, progress)
                      if "onnxruntime" in config.systems else {})
            for batch in config.batches:
                if "kiln" in config.systems:
                    rows.append(_measure("kiln", m.quantization, path, None, batch, config, progress,
                                         _params_mb(path)))
                for name, folder in graphs.items():
                    rows.append(_measure(name, m.quantization, path, folder, batch, config, progress,
                                         _folder_mb(folder)))
        if "torch" in config.systems:
            fp32 = [a for a, m in zip(artifacts, manifests) if m.quantization == "fp32"]
            for batch in config.batches:  # torch's weights are the float32 artifact's, byte for byte
                rows.append(_measure("torch eager", "fp32", artifacts[0], None, batch, config, progress,
                                     _params_mb(fp32[0]) if fp32 else None))
    return Report(config, bandwidth / 1e9, tuple(rows), rooflines)


def _ort_graphs(manifest, modules: dict, folder: Path, progress) -> dict[str, Path]:
    """Export the artifact's source model once per variant: {system name: folder}."""
    from kiln.compiler.models.source import resolve_model

    key = (manifest.source, manifest.model.context_length)
    if key not in modules:
        modules[key] = resolve_model(*key).build_module()
    quant = quant_from_record(manifest.extra.get("quantization"))
    variants = {"onnxruntime": quant}
    if not quant.is_float and (quant.embedding or quant.lm_head):
        variants["ort proj-only"] = QuantConfig(quant.scheme, embedding=False, lm_head=False)
    out = {}
    for name, q in variants.items():
        progress(f"exporting ONNX for {name} ({manifest.quantization})")
        out[name] = _export(modules[key], q, folder / name.replace(" ", "-"), fast_int4=name == "ort proj-only")
    return out


def _export(module, quant: QuantConfig, folder: Path, fast_int4: bool = False) -> Path:
    """Fresh graphs per variant: the quantization rewrite works in place. ``fast_int4``:
    int4 weights in the form onnxruntime fuses (ort_zero_point.py)."""
    import onnx_ir as ir

    from kiln.compiler.export.onnx_export import export_graphs
    from kiln.compiler.passes.quantize_weights import quantize_weights

    from .ort_zero_point import integer_zero_points

    rewrite = quantize_weights(quant)
    folder.mkdir(parents=True, exist_ok=True)
    for name, graph in export_graphs(module).items():
        graph = rewrite(graph)
        if fast_int4 and quant.scheme.kind == "int4":
            graph = integer_zero_points(graph)
        ir.save(graph, folder / f"{name}.onnx", external_data=f"{name}.onnx.data")
    return folder


def _params_mb(artifact: Path) -> float:
    return (artifact / PARAMS_FILE).stat().st_size / 2**20


def _folder_mb(folder: Path) -> float:
    # Both graphs hold the same weights: count one graph's (prefill) files.
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("prefill.")) / 2**20


def _measure(system: str, quant: str, artifact: Path, onnx: Path | None, batch: int, config: BenchConfig,
             progress, size_mb: float | None) -> Row:
    kind = {"ort proj-only": "onnxruntime", "torch eager": "torch"}.get(system, system)
    cmd = [sys.executable, "-m", "kiln.bench.worker", kind, "--artifact", str(artifact), "--batch", str(batch),
           "--prompt-len", str(config.prompt_len), "--steps", str(config.steps), "--repeats", str(config.repeats)]
    if onnx is not None:
        cmd += ["--onnx", str(onnx)]
    env = dict(os.environ)
    if kind == "kiln":
        env["TVM_USE_RUNTIME_LIB"] = "1"  # what a serving box loads
    progress(f"{quant:>9} batch {batch:>3}  {system}")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} (batch {batch}) failed:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return Row(quant, system, batch, batch * config.prompt_len / r["prefill_s"],
               batch * config.steps / r["decode_s"], 1000 * r["decode_s"] / config.steps,
               r["rss_peak_mb"], r["rss_peak_mb"] - r["rss_base_mb"], float("nan") if size_mb is None else size_mb)


def format_report(report: Report) -> str:
    c = report.config
    lines = [f"prompt {c.prompt_len} tokens, {c.steps} decode steps, median of {c.repeats}; "
             f"{len(os.sched_getaffinity(0))} CPUs; measured read bandwidth {report.bandwidth_gb_s:.1f} GB/s",
             "",
             f"{'quant':>9} {'batch':>5}  {'system':<14} {'prefill tok/s':>13} {'decode tok/s':>12} "
             f"{'step ms':>8} {'vs ort':>7} {'peak RSS MB':>11} {'model MB':>9} {'weights MB':>10}"]
    by_key = {(r.quant, r.system, r.batch): r for r in report.rows}
    order = list(dict.fromkeys(r.quant for r in report.rows if r.system != "torch eager"))
    for quant in order:
        for batch in c.batches:
            ort = by_key.get((quant, "onnxruntime", batch))
            torch_row = by_key.get(("fp32", "torch eager", batch))
            group = [r for r in report.rows if r.quant == quant and r.batch == batch and r.system != "torch eager"]
            for r in group + ([torch_row] if torch_row else []):
                vs = f"{r.decode_tok_s / ort.decode_tok_s:>6.2f}x" if ort else f"{'':>7}"
                size = "" if r.size_mb != r.size_mb else f"{r.size_mb:>10.1f}"
                lines.append(f"{quant:>9} {batch:>5}  {r.system:<14} {r.prefill_tok_s:>13.1f} {r.decode_tok_s:>12.1f} "
                             f"{r.step_ms:>8.1f} {vs} {r.rss_peak_mb:>11.0f} {r.model_mb:>9.0f} {size}")
        lines.append("")
    lines.append("batch-1 decode roofline (bandwidth / bytes read per token) and each system's fraction of it:")
    for roof in report.rooflines:
        parts = [f"{r.system} {r.decode_tok_s / roof.tok_s:.0%}" for r in report.rows
                 if r.batch == 1 and (r.quant == roof.quant or r.system == "torch eager" and roof.quant == "fp32")]
        lines.append(f"{roof.quant:>9}: {roof.bytes_per_token / 2**20:7.1f} MiB/token -> {roof.tok_s:6.1f} tok/s; "
                     + ", ".join(parts))
    lines.append("(vs ort: decode tokens/s against onnxruntime on the same quantized graph, same batch; torch eager "
                 "runs float32)")
    return "\n".join(lines)


def write_outputs(report: Report, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bench.json"]
    written[0].write_text(json.dumps(report.to_json(), indent=2))
    try:
        from .plot import plot_report
    except ImportError:  # matplotlib is the optional `bench` extra
        return written
    written.append(plot_report(report, out / "bench.png"))
    return written
