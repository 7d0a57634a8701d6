"""The KV cache sized from a memory budget (``kv_cache_memory`` / ``--kv-cache-memory``):
the budget's forms, bytes per token for each KV dtype, pages from a budget against
independent arithmetic (brute force for the smallest cache), refusals at load (more than
the machine has, less than one full-context sequence), and one engine over the tiny
artifact whose scheduler, ``/metrics`` and ``kiln inspect`` show the sizes."""

from __future__ import annotations

import dataclasses
import os

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from fakes import FakeExecutor, FakeTokenizer, expected_greedy, fake_model, run_to_idle
from kiln.runtime import kv_budget
from kiln.runtime.artifact import Manifest, TargetInfo, load_manifest
from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.errors import ArtifactError, ConfigError
from kiln.runtime.kv_budget import AvailableMemory, KVCacheMemory, host_available_memory
from kiln.runtime.kv_sizing import kv_bytes_per_token
from test_server import serve

GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10
PAGE = FakeExecutor.page_size


def bytes_per_token(model, dtype: str) -> int:
    """keys + values over all layers: a head row is D float32 / float16, or D int8 and a float32 scale."""
    row = {"float32": 4 * model.head_dim, "float16": 2 * model.head_dim, "int8": model.head_dim + 4}[dtype]
    return model.num_layers * 2 * model.num_kv_heads * row


def smallest_cache_pages(context: int, page: int, watermark: float) -> int:
    """By brute force: the fewest pages holding one full-context sequence and a page, its
    pages plus one for the output above the watermark."""
    return next(p for p in range(1, 100_000)
                if (p - 1) * page >= context + page and p - int(p * watermark) >= -(-context // page) + 1)


# -- the option's forms ----------------------------------------------------------------------
@pytest.mark.parametrize("text, amount", [
    ("2GiB", {"bytes": 2 * GIB}), ("512MiB", {"bytes": 512 * MIB}), ("1.5GB", {"bytes": 15 * 10 ** 8}),
    ("800M", {"bytes": 800 * 10 ** 6}), ("800mb", {"bytes": 800 * 10 ** 6}), ("123456", {"bytes": 123456}),
    ("64KiB", {"bytes": 64 * KIB}), (" 2 gib ", {"bytes": 2 * GIB}), ("4096B", {"bytes": 4096}),
    ("0.3", {"fraction": 0.3}), ("30%", {"fraction": 0.3}), (".5", {"fraction": 0.5}), ("100%", {"fraction": 1.0}),
    (4096, {"bytes": 4096}), (0.25, {"fraction": 0.25}),
])
def test_accepted_forms(text, amount):
    parsed = KVCacheMemory.parse(text)
    assert parsed.bytes == amount.get("bytes")
    assert parsed.fraction == pytest.approx(amount.get("fraction"))
    assert EngineConfig(kv_cache_memory=text).kv_cache_memory == parsed


@pytest.mark.parametrize("text", ["", "abc", "0", "0%", "150%", "1.5", "-1", "2XB", "1e9", "nan", "2 GiB/s",
                                  "1,000", True, [1], 0, 2.0])
def test_refused_forms_name_the_option_and_the_forms(text):
    with pytest.raises(ConfigError, match=r"^--kv-cache-memory: .*2GiB, 512MiB.* 30%") as err:
        KVCacheMemory.parse(text, option="--kv-cache-memory")
    assert isinstance(err.value, ValueError) and err.value.option == "--kv-cache-memory"
    with pytest.raises(ValueError, match="^kv_cache_memory: "):
        EngineConfig(kv_cache_memory=text)


def test_a_token_count_and_a_budget_together_are_refused():
    with pytest.raises(ValueError, match="max_total_tokens or kv_cache_memory"):
        EngineConfig(max_total_tokens=4096, kv_cache_memory="1GiB")


def test_available_memory_reads_meminfo_else_sysconf(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:    1234567 kB\n")
    assert host_available_memory(str(meminfo)).bytes == 1234567 * 1024
    fallback = host_available_memory(str(tmp_path / "missing"))
    assert fallback.bytes == pytest.approx(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), rel=0.2)
    assert "sysconf" in fallback.source


# -- bytes per token and pages from a budget ------------------------------------------------
MODEL = dataclasses.replace(fake_model(context=96), num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)


def manifest(**kv_cache) -> Manifest:
    """A manifest with only what sizing reads (the fake executor runs no functions)."""
    return Manifest(1, "test", "test", MODEL, TargetInfo("llvm", "cpu"), "fp32", "float32",
                    {"layout": "paged", "page_size": PAGE, **kv_cache}, {}, (), {})


def engine_for(kv_cache: dict, **config) -> Engine:
    return Engine(MODEL, FakeExecutor(), FakeTokenizer(), EngineConfig(**config), manifest(**kv_cache),
                  background=False)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_bytes_per_token_of_each_dtype(dtype):
    assert kv_bytes_per_token(MODEL, {"dtype": dtype}) == bytes_per_token(MODEL, dtype)
    assert kv_bytes_per_token(MODEL, {"dtype": dtype, "bytes_per_token": 777}) == 777  # the manifest's word wins


def test_older_manifests_hold_float32_and_bad_entries_are_artifact_errors():
    assert kv_bytes_per_token(MODEL, {}) == bytes_per_token(MODEL, "float32")
    with pytest.raises(ArtifactError, match="kv_dtype"):
        kv_bytes_per_token(MODEL, {"dtype": "bfloat8"})
    with pytest.raises(ArtifactError, match="bytes_per_token"):
        kv_bytes_per_token(MODEL, {"bytes_per_token": -4})


@pytest.mark.parametrize("dtype, stated", [("float32", False), ("float16", False), ("int8", False), ("int8", True)])
def test_pages_from_a_budget(dtype, stated):
    per_token = bytes_per_token(MODEL, dtype)
    kv_cache = {"dtype": dtype, **({"bytes_per_token": per_token} if stated else {})}
    budget = per_token * PAGE * 61 + per_token * 3 + 5  # 61 whole pages and a part of one
    engine = engine_for(kv_cache, kv_cache_memory=budget, max_num_seqs=2, max_batched_tokens=32)
    pages = budget // per_token // PAGE
    # TVM's cache holds ceil(tokens / page) + 1 pages: the extra page is inside the budget.
    assert engine.scheduler.config.total_pages == engine.cache.total_pages == pages == 61
    assert engine.core.cache_config.max_total_tokens == (pages - 1) * PAGE
    cap = engine.kv_capacity
    assert (cap.dtype, cap.bytes_per_token, cap.pages, cap.budget) == (dtype, per_token, pages, budget)
    assert cap.tokens == pages * PAGE and cap.bytes == pages * PAGE * per_token <= budget
    assert cap.full_context_sequences == pages * PAGE // MODEL.context_length
    # Admission follows the budget's pages: the longest prompt is served.
    longest = [1 + i % 60 for i in range(MODEL.context_length - 1)]
    stream = engine.submit(" ".join(map(str, longest)), max_tokens=3)
    run_to_idle(engine)
    assert list(stream.result().token_ids) == expected_greedy(longest, 1)


@pytest.mark.parametrize("watermark", [0.01, 0.3])
def test_a_budget_below_one_full_context_sequence_is_refused_with_the_minimum(watermark):
    page_bytes = bytes_per_token(MODEL, "float16") * PAGE
    least = smallest_cache_pages(MODEL.context_length, PAGE, watermark)
    engine = engine_for({"dtype": "float16"}, kv_cache_memory=least * page_bytes, watermark=watermark)
    assert engine.scheduler.config.total_pages == least
    with pytest.raises(ConfigError, match=f"at least {least * page_bytes:,} bytes") as err:
        engine_for({"dtype": "float16"}, kv_cache_memory=least * page_bytes - 1, watermark=watermark)
    assert err.value.option == "kv_cache_memory"


def test_a_budget_above_available_memory_is_refused(monkeypatch):
    per_token = bytes_per_token(MODEL, "float32")
    available = 300 * PAGE * per_token
    monkeypatch.setattr(kv_budget, "available_memory", lambda device=None: AvailableMemory(available, "test"))
    with pytest.raises(ConfigError, match=f"{available + 1:,} bytes .* only {available:,} bytes") as err:
        engine_for({}, kv_cache_memory=available + 1)
    assert err.value.option == "kv_cache_memory"
    assert engine_for({}, kv_cache_memory=available).scheduler.config.total_pages == 300
    # A fraction is of what is available, never above it.
    half = engine_for({}, kv_cache_memory="50%")
    assert half.kv_capacity.budget == available // 2
    assert half.scheduler.config.total_pages == available // 2 // per_token // PAGE


def test_without_a_budget_sizing_is_unchanged():
    """The default: the context window, at least 8,192 tokens, in TVM's pages."""
    engine = engine_for({})
    assert engine.scheduler.config.total_pages == -(-8192 // PAGE) + 1 and engine.kv_capacity.budget is None
    assert engine_for({}, max_total_tokens=400).scheduler.config.total_pages == 400 // PAGE + 1


# -- the tiny artifact: engine, /metrics, CLI ----------------------------------------------
def test_an_artifact_served_from_a_budget_shows_its_sizes(compiled):
    folder = compiled("llama")
    m = load_manifest(folder)
    per_token = bytes_per_token(m.model, m.kv_cache.get("dtype", "float32"))
    page = m.kv_cache["page_size"]
    engine = Engine.load(folder, EngineConfig(max_num_seqs=4, max_batched_tokens=128, kv_cache_memory="1MiB"))
    try:
        pages = MIB // per_token // page
        assert engine.scheduler.config.total_pages == engine.cache.total_pages == pages
        assert engine.generate("The quick brown fox", max_tokens=4, ignore_eos=True).completion_tokens == 4
        with serve(engine) as url:
            text = httpx.get(f"{url}/metrics").text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        tokens = pages * page
        assert samples[("kiln_kv_cache_bytes", ())] == tokens * per_token
        assert samples[("kiln_kv_cache_capacity_tokens", ())] == tokens
        assert samples[("kiln_kv_cache_full_context_sequences", ())] == tokens // m.model.context_length
        assert samples[("kiln_kv_bytes_per_token", ())] == per_token
        assert samples[("kiln_kv_pages_total", ())] == pages
        info = (("dtype", m.kv_cache.get("dtype", "float32")), ("page_size", str(page)))
        assert samples[("kiln_kv_cache_info", info)] == 1
    finally:
        engine.close()


def test_cli_flag_and_inspect_row(compiled):
    from kiln.cli.main import cli
    import kiln.cli.runtime_cmds  # noqa: F401

    folder = compiled("llama")
    m = load_manifest(folder)
    runner = CliRunner()
    bad = runner.invoke(cli, ["serve", str(folder), "--kv-cache-memory", "lots"])
    assert bad.exit_code == 1 and "--kv-cache-memory: expected" in bad.output
    both = runner.invoke(cli, ["serve", str(folder), "--kv-cache-memory", "1GiB", "--max-total-tokens", "4096"])
    assert both.exit_code == 2 and "not both" in both.output
    shown = runner.invoke(cli, ["inspect", str(folder)])
    assert shown.exit_code == 0, shown.output
    per_token = bytes_per_token(m.model, m.kv_cache.get("dtype", "float32"))
    per_gib = GIB / (per_token * m.model.context_length)
    assert (f"kv cache  {m.kv_cache.get('dtype', 'float32')}, {per_token:,} B/token, {m.kv_cache['page_size']}-token "
            f"pages; {per_gib:,.1f} full-context sequences per GiB") in shown.output
