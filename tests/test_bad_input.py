"""Bad input gets a clear, typed error naming what is wrong, and from the CLI a non-zero
exit with one line on stderr, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.runtime.engine import Engine
from kiln.runtime.errors import ArtifactError, InvalidRequestError, PromptTooLongError, UnsupportedModelError
from kiln.runtime.sampling import SamplingParams


def _kiln(*args, timeout=300):
    """Run the real ``kiln`` command; returns (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def _assert_clean_failure(code, err, *needles):
    assert code != 0
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.fixture
def artifact_copy(compiled, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(compiled("llama"), dst)
    return dst


def test_missing_artifact(tmp_path):
    code, _, err = _kiln("generate", str(tmp_path / "nope"), "hi")
    _assert_clean_failure(code, err, "no such artifact")


def test_corrupt_manifest(artifact_copy):
    (artifact_copy / "manifest.json").write_text("{ not json")
    code, _, err = _kiln("generate", str(artifact_copy), "hi")
    _assert_clean_failure(code, err, "corrupt manifest")


def test_hash_mismatch(artifact_copy):
    path = artifact_copy / "params.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    code, _, err = _kiln("generate", str(artifact_copy), "hi")
    _assert_clean_failure(code, err, "params.bin", "sha256 does not match")


def test_missing_file(artifact_copy):
    (artifact_copy / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer.json is missing"):
        Engine.load(artifact_copy)


def test_schema_too_new(artifact_copy):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["schema_version"] = 99
    path.write_text(json.dumps(manifest))
    code, _, err = _kiln("inspect", str(artifact_copy))
    _assert_clean_failure(code, err, "schema version 99 is newer")


@pytest.mark.parametrize("value", [0, -2, "4", 1.5, True])
def test_invalid_dispatch(artifact_copy, value):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["dispatch"] = {"decode_max_batch": value}
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="decode_max_batch must be a positive integer"):
        Engine.load(artifact_copy)


@pytest.mark.parametrize("field", ["static_decode", "static_prefill"])
@pytest.mark.parametrize("value", [[0], "1", [1.5], [True], [4, 4]])
def test_invalid_static_buckets(artifact_copy, field, value):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["dispatch"][field] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"{field} must be a list of distinct positive integers"):
        Engine.load(artifact_copy)


def test_static_decode_bucket_missing(artifact_copy):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["dispatch"]["static_decode"] = [1, 3]  # the library has decode_b1 only
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="lacks the function.s. decode_b3"):
        Engine.load(artifact_copy)


def test_static_prefill_bucket_missing(artifact_copy):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["dispatch"]["static_prefill"] = [7]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="lacks the function.s. prefill_t7"):
        Engine.load(artifact_copy)


def test_cuda_artifact_without_gpu(compiled):
    if Path("/dev/nvidia0").exists():
        pytest.skip("this host has a GPU")
    code, _, err = _kiln("generate", str(compiled("llama", "cuda:sm_90")), "hi")
    _assert_clean_failure(code, err, "CUDA", "no CUDA GPU" if "libcuda" not in err else "libcuda")


def test_prompt_longer_than_context(compiled):
    engine = Engine.load(compiled("llama"))
    long_prompt = "fox " * (engine.config.context_length + 10)
    with pytest.raises(PromptTooLongError, match="context window of 128"):
        engine.generate(long_prompt)
    code, _, err = _kiln("generate", str(compiled("llama")), long_prompt)
    _assert_clean_failure(code, err, "context window")
    # The engine is still usable afterwards.
    assert engine.generate("fox", max_tokens=3, ignore_eos=True).completion_tokens == 3


@pytest.mark.parametrize("flag,value,field", [
    ("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"), ("--top-p", "1.5", "top_p"),
    ("--top-k", "-1", "top_k"), ("--max-tokens", "0", "max_tokens"), ("--temperature", "nan", "temperature"),
])
def test_invalid_sampling_values_cli(compiled, flag, value, field):
    code, _, err = _kiln("generate", str(compiled("llama")), "hi", flag, value)
    _assert_clean_failure(code, err, field)


@pytest.mark.parametrize("overrides,field", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": 1.5}, "top_k"),
    ({"max_tokens": -3}, "max_tokens"), ({"seed": -1}, "seed"), ({"stop": [""]}, "stop"),
    ({"stop": [1, 2]}, "stop"), ({"frequency": 1}, "frequency"), ({"stop_token_ids": [10**9]}, "stop_token_ids"),
])
def test_invalid_sampling_values_api(compiled, overrides, field):
    engine = Engine.load(compiled("llama"))
    with pytest.raises(InvalidRequestError) as info:
        engine.generate("hi", **overrides)
    assert info.value.field == field


def test_invalid_chat_messages(compiled):
    engine = Engine.load(compiled("llama"))
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].role"):
        engine.generate([{"role": "wizard", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match=r"messages\[1\].content"):
        engine.generate([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}])


def test_sampling_params_are_frozen_and_validated_once():
    p = SamplingParams(temperature=0.5, stop="END")
    assert p.stop == ("END",)
    with pytest.raises(Exception):
        p.temperature = 1.0  # frozen


def test_compile_rejects_unknown_architecture(tmp_path, checkpoint):
    folder = tmp_path / "gpt2"
    shutil.copytree(checkpoint("llama"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    code, _, err = _kiln("compile", str(folder), "--out", str(tmp_path / "out"))
    _assert_clean_failure(code, err, "gpt2", "not supported")


def test_compile_rejects_missing_files_and_bad_targets(tmp_path, checkpoint):
    from kiln.compiler.models.source import resolve_model
    from kiln.compiler.targets import parse_target

    folder = tmp_path / "no-tokenizer"
    shutil.copytree(checkpoint("llama"), folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedModelError, match="no tokenizer.json"):
        resolve_model(folder).load_tokenizer()
    (folder / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match="no \\*.safetensors"):
        resolve_model(folder).build_module()
    with pytest.raises(UnsupportedModelError, match="no such model"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="tpu"):
        parse_target("tpu")
    with pytest.raises(ValueError, match="sm_70"):
        parse_target("cuda:sm_70")
    code, _, err = _kiln("compile", str(checkpoint("llama")), "--target", "tpu", "--out", str(tmp_path / "o"))
    _assert_clean_failure(code, err, "tpu")


def test_compile_never_overwrites_a_non_artifact_folder(tmp_path, checkpoint):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "thesis.txt").write_text("do not delete")
    code, _, err = _kiln("compile", str(checkpoint("llama")), "--out", str(out))
    _assert_clean_failure(code, err, "not a Kiln artifact")
    assert (out / "thesis.txt").read_text() == "do not delete"
