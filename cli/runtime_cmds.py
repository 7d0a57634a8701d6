"""``kiln generate`` and ``kiln inspect``: runtime only (TVM runtime, numpy, tokenizers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kiln.runtime.server.config import ServerConfig

from .main import cli, handle_errors

ARTIFACT = click.Path(path_type=Path)


@cli.command("inspect")
@click.argument("artifact", type=ARTIFACT)
@click.option("--json", "as_json", is_flag=True, help="print the whole manifest as JSON")
@handle_errors
def inspect_command(artifact, as_json):
    """Print ARTIFACT's manifest."""
    from kiln.runtime.artifact import load_manifest

    m = load_manifest(artifact)
    if as_json:
        click.echo(json.dumps(m.to_dict(), indent=2))
        return
    c = m.model
    size = sum(f.bytes for f in m.files.values())
    target = m.target.key + (f" ({m.target.mcpu})" if m.target.mcpu else "")
    rows = [
        ("model", f"{c.name or '?'} [{c.architecture}] from {m.source}"),
        ("shape", f"{c.num_layers} layers, hidden {c.hidden_size}, heads {c.num_heads}/{c.num_kv_heads} kv, "
                  f"head_dim {c.head_dim}, ffn {c.intermediate_size}, vocab {c.vocab_size}"),
        ("context", f"{c.context_length} tokens"),
        ("target", target),
        ("weights", f"{m.quantization}, {len(m.params)} tensors, activations {_activations(m.activation_dtype, m.target.cpu_features)}"),
        ("kv cache", _kv_cache_row(m)),
        ("functions", ", ".join(m.functions)),
        ("dispatch", _dispatch_row(m.dispatch)),
        ("schedules", m.extra.get("schedules", "not recorded")),
        ("files", ", ".join(f"{n} ({f.bytes / 2**20:.1f} MiB)" for n, f in m.files.items())),
        ("size", f"{size / 2**20:.1f} MiB"),
        ("built", f"kiln {m.kiln_version}, tvm {m.tvm_version}, {m.created}, schema {m.schema_version}"),
    ]
    for key, value in rows:
        click.echo(f"{key:>10}  {value}")


@cli.command("generate")
@click.argument("artifact", type=ARTIFACT)
@click.argument("prompt")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 disables")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--chat", is_flag=True, help="apply the model's chat template to PROMPT as a user message")
@click.option("--system", default=None, help="system message (implies --chat)")
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="constrain the output to JSON valid under the JSON schema in this file")
@click.option("--regex", default=None, help="constrain the output to match this regular expression")
@click.option("--stats/--no-stats", default=True, show_default=True, help="print timing to stderr")
@handle_errors
def generate_command(artifact, prompt, max_tokens, temperature, top_k, top_p, seed, stop, chat, system,
                     json_schema, regex, stats):
    """Stream a generation for PROMPT from ARTIFACT to the terminal."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.guided import Guide
    from kiln.runtime.sampling import SamplingParams

    if json_schema is not None and regex is not None:
        raise click.UsageError("give --json-schema or --regex, not both")
    guide = None
    if json_schema is not None:
        guide = Guide.json_schema(Path(json_schema).read_text(encoding="utf-8"), field="--json-schema")
    elif regex is not None:
        guide = Guide.regex(regex, field="--regex")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=tuple(stop), guide=guide)
    engine = Engine.load(artifact)
    request = prompt
    if chat or system is not None:
        request = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}]
    def show(delta):
        click.echo(delta.text, nl=False)
        sys.stdout.flush()

    result = engine.generate(request, params, on_token=show)
    click.echo()
    sys.stdout.flush()
    if stats:
        click.echo(
            f"[{result.prompt_tokens} prompt + {result.completion_tokens} generated tokens, "
            f"finish: {result.finish_reason}, first token {result.time_to_first_token_s * 1000:.0f} ms, "
            f"decode {result.decode_tokens_per_s:.1f} tok/s]", err=True)


@cli.command("serve")
@click.argument("artifact", type=ARTIFACT)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--served-model-name", default=None, help="model id clients use [default: the artifact folder name]")
@click.option("--max-num-seqs", type=int, default=16, show_default=True, help="sequences batched per step")
@click.option("--max-batched-tokens", type=int, default=None,
              help="tokens per step (the prefill chunk) [default: the artifact's static prefill bucket, "
                   "128 on CPU, else 512]")
@click.option("--max-total-tokens", type=int, default=None,
              help="KV-cache capacity in tokens [default: the context window, at least 8192]")
@click.option("--kv-cache-memory", default=None,
              help="KV-cache memory budget instead of --max-total-tokens: bytes (2GiB, 512MiB, 1.5GB, 800M, "
                   "123456) or a fraction of the memory available at load (0.3, 30%)")
@click.option("--policy", type=click.Choice(["fcfs", "priority"]), default="fcfs", show_default=True)
@click.option("--max-waiting", type=int, default=256, show_default=True,
              help="queued requests beyond which new ones get HTTP 429")
@click.option("--no-prefix-reuse", is_flag=True, help="do not share KV pages of common prompt prefixes")
@click.option("--api-key", envvar="KILN_API_KEY", default=None, show_envvar=True,
              help="require 'Authorization: Bearer KEY' on /v1/* [default: no key]")
@click.option("--api-key-all-routes", is_flag=True, help="require the API key on /health, /ready and /metrics too")
@click.option("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes, show_default=True,
              help="larger request bodies get HTTP 413")
@click.option("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout_s, show_default=True,
              help="seconds running requests get to finish after SIGTERM/SIGINT before they are ended")
@click.option("--header-timeout", type=float, default=ServerConfig.header_timeout_s, show_default=True,
              help="seconds a connection may take to send a request head")
@click.option("--keep-alive-timeout", type=float, default=ServerConfig.keep_alive_s, show_default=True,
              help="seconds an idle keep-alive connection stays open")
@click.option("--log-level", default="info", show_default=True)
@handle_errors
def serve_command(artifact, host, port, served_model_name, max_num_seqs, max_batched_tokens, max_total_tokens,
                  kv_cache_memory, policy, max_waiting, no_prefix_reuse, api_key, api_key_all_routes,
                  max_request_bytes, shutdown_timeout, header_timeout, keep_alive_timeout, log_level):
    """Serve ARTIFACT over an OpenAI-compatible HTTP API (graceful on SIGTERM/SIGINT)."""
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.kv_budget import KVCacheMemory
    from kiln.runtime.server.serve import serve

    if max_total_tokens is not None and kv_cache_memory is not None:
        raise click.UsageError("give --max-total-tokens or --kv-cache-memory, not both")
    if kv_cache_memory is not None:
        kv_cache_memory = KVCacheMemory.parse(kv_cache_memory, option="--kv-cache-memory")
    config = EngineConfig(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                          max_total_tokens=max_total_tokens, kv_cache_memory=kv_cache_memory, policy=policy,
                          max_waiting=max_waiting, prefix_reuse=not no_prefix_reuse)
    server_config = ServerConfig(api_key=api_key, api_key_all_routes=api_key_all_routes,
                                 max_request_bytes=max_request_bytes, shutdown_timeout_s=shutdown_timeout,
                                 header_timeout_s=header_timeout, keep_alive_s=keep_alive_timeout)
    engine = Engine.load(artifact, config)
    name = served_model_name or Path(artifact).resolve().name
    click.echo(f"serving {name} on http://{host}:{port}/v1 (prompts up to {engine.max_prompt_tokens} tokens"
               f"{'; API key required' if api_key else ''})\n{engine.kv_capacity.describe()}", err=True)
    try:
        serve(engine, name, server_config, host=host, port=port, log_level=log_level)
    finally:
        engine.close()


def _kv_cache_row(manifest) -> str:
    """"float16, 23,040 B/token, 16-token pages; 5.7 full-context sequences per GiB"."""
    from kiln.runtime.kv_sizing import kv_bytes_per_token, kv_dtype, sequences_per_gib

    model = manifest.model
    per_token = kv_bytes_per_token(model, manifest.kv_cache)
    return (f"{kv_dtype(manifest.kv_cache)}, {per_token:,} B/token, {manifest.kv_cache.get('page_size', '?')}-token "
            f"pages; {sequences_per_gib(per_token, model.context_length):,.1f} full-context sequences per GiB")


def _activations(dtype: str, cpu_features: tuple[str, ...]) -> str:
    if dtype == "int8":
        # The kernels build for the target's best dot-product ISA (compiler/targets.py DOT_ISAS).
        isa = "AVX-512 VNNI" if "avx512_vnni" in cpu_features else "AVX2"
        return f"int8 (per row and block of 16; {isa} integer dot products)"
    return dtype


def _dispatch_row(dispatch) -> str:
    row = ("decode: every batch" if dispatch.decode_max_batch is None else
           f"decode up to {dispatch.decode_max_batch} sequences, prefill above")
    for batch in dispatch.static_decode:
        row += f"; {dispatch.static_function(batch)} (static shapes) for {batch}"
    if dispatch.static_prefill:
        from kiln.runtime.artifact import prefill_bucket_name

        pieces = ", ".join(prefill_bucket_name(t) for t in sorted(dispatch.static_prefill, reverse=True))
        row += f"; prefills run in static pieces ({pieces}), the rest through prefill"
    return row
