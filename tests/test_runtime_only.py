"""The runtime needs only the TVM runtime library, numpy and tokenizers: prove it in a
subprocess that cannot import torch, onnx or the compiler and still generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
for name in ("torch", "onnx", "onnxruntime", "onnx_ir", "onnxscript", "transformers", "kiln.compiler"):
    sys.modules[name] = None  # any import of these now raises ImportError
from kiln.runtime.engine import Engine
engine = Engine.load(sys.argv[1])
out = engine.generate("The quick brown fox", max_tokens=8, ignore_eos=True)
maps = open("/proc/self/maps").read()
print(json.dumps({
    "tokens": list(out.token_ids),
    "compiler_mapped": "libtvm_compiler" in maps,
    "runtime_mapped": "libtvm_runtime" in maps,
    "loaded": sorted(m for m in sys.modules if sys.modules[m] is not None and m.split(".")[0] in
                     ("torch", "onnx", "onnxruntime", "transformers") or m.startswith("kiln.compiler")
                     and sys.modules[m] is not None),
}))
"""


def test_runtime_generates_without_compiler_torch_or_onnx(compiled):
    folder = compiled("llama")
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["tokens"]) == 8
    assert report["runtime_mapped"] and not report["compiler_mapped"]
    assert report["loaded"] == []

    # The same tokens as in this (full-TVM) process.
    from kiln.runtime.engine import Engine

    assert list(Engine.load(folder).generate("The quick brown fox", max_tokens=8, ignore_eos=True).token_ids) == \
        report["tokens"]
