"""The PNG of ``kiln bench``: throughput against latency, one line per (scheme, system)
through the batch sizes, so the cost of each serving choice is visible at a glance."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_STYLE = {"kiln": "-", "onnxruntime": "--", "ort proj-only": ":", "torch eager": "-."}


def plot_report(report, path: Path) -> Path:
    fig, (dec, pre) = plt.subplots(1, 2, figsize=(13, 5.5))
    lines = sorted({(r.quant, r.system) for r in report.rows})
    colors = {q: f"C{i}" for i, q in enumerate(dict.fromkeys(q for q, _ in lines))}
    for quant, system in lines:
        rows = sorted((r for r in report.rows if r.quant == quant and r.system == system), key=lambda r: r.batch)
        label = f"{system} ({quant})"
        style = dict(linestyle=_STYLE.get(system, "-"), marker="o", color=colors[quant], label=label)
        dec.plot([r.step_ms for r in rows], [r.decode_tok_s for r in rows], **style)
        prefill_ms = [1000 * r.batch * report.config.prompt_len / r.prefill_tok_s for r in rows]
        pre.plot(prefill_ms, [r.prefill_tok_s for r in rows], **style)
        for r, x in zip(rows, prefill_ms):
            dec.annotate(f"B{r.batch}", (r.step_ms, r.decode_tok_s), fontsize=7, xytext=(3, 3),
                         textcoords="offset points")
            pre.annotate(f"B{r.batch}", (x, r.prefill_tok_s), fontsize=7, xytext=(3, 3), textcoords="offset points")
    dec.set(xlabel="decode step latency (ms, whole batch)", ylabel="decode tokens/s", xscale="log",
            title="decode: throughput vs inter-token latency")
    pre.set(xlabel=f"prefill latency (ms, batch x {report.config.prompt_len} tokens)", ylabel="prefill tokens/s",
            xscale="log", title="prefill: throughput vs time to first token")
    for ax in (dec, pre):
        ax.grid(True, which="both", alpha=0.3)
    dec.legend(fontsize=7, loc="best")
    fig.suptitle(f"kiln bench (read bandwidth {report.bandwidth_gb_s:.1f} GB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
