"""Installing Kiln puts one import root, ``kiln``, into site-packages, and the ``kiln``
command is a thin shell that streams."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_has_only_the_kiln_import_root(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=600)
    wheel = next(tmp_path.glob("kiln_llm-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    roots = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert roots == {"kiln"}
    for module in ("kiln/compiler/compile.py", "kiln/runtime/engine.py", "kiln/cli/main.py",
                   "kiln/compiler/lower/converters/attention.py"):
        assert module in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kiln = kiln.cli.main:main" in entry_points


def test_cli_generate_streams_and_reports(compiled):
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "generate", str(compiled("llama")), "Hello there",
                           "--chat", "--max-tokens", "6", "--temperature", "0.9", "--seed", "3"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    from kiln.runtime.engine import Engine

    expected = Engine.load(compiled("llama")).generate([{"role": "user", "content": "Hello there"}],
                                                       max_tokens=6, temperature=0.9, seed=3)
    assert proc.stdout == expected.text + "\n"
    assert "prompt +" in proc.stderr and "finish:" in proc.stderr


def test_a_kiln_folder_in_the_working_directory_does_not_shadow_kiln(tmp_path):
    """`python -m` / `-c` put the working directory first on sys.path. A `kiln` folder there
    without __init__.py (artifacts, say) would be an empty namespace package that the
    editable install's finder, left behind the PathFinder by setuptools, loses to; the build
    backend (build_backend/kiln_build.py) puts the finder first. The console script never
    has the working directory on sys.path."""
    (tmp_path / "kiln" / "runtime").mkdir(parents=True)
    from kiln.runtime.version import __version__

    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    probe = ("import kiln, kiln.runtime; assert kiln.runtime.__file__, kiln.runtime; "
             "print('kiln, version', kiln.__version__)")
    commands = {
        "kiln --version": [str(Path(sys.executable).parent / "kiln"), "--version"],
        "python -m kiln.cli.main --version": [sys.executable, "-m", "kiln.cli.main", "--version"],
        "python -m kiln.cli --version": [sys.executable, "-m", "kiln.cli", "--version"],
        "python -c 'import kiln'": [sys.executable, "-c", probe],
    }
    for name, command in commands.items():
        proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
        assert (proc.returncode, proc.stdout.strip()) == (0, f"kiln, version {__version__}"), (name, proc.stderr)
