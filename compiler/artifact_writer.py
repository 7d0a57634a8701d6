"""Write an artifact folder (layout and schema: ``kiln.runtime.artifact``).

Everything is written into a temporary sibling folder and renamed into place at the end,
so an interrupted compile never leaves a half-written artifact behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from kiln.runtime.artifact import (
    LIBRARY_FILE,
    MANIFEST,
    PARAM_ALIGNMENT,
    PARAMS_FILE,
    FileEntry,
    Manifest,
    TensorEntry,
    sha256_file,
)
from kiln.runtime.errors import KilnError


def write_params(path: Path, named: Sequence[tuple[str, np.ndarray]]) -> tuple[TensorEntry, ...]:
    entries = []
    offset = 0
    with open(path, "wb") as f:
        for name, array in named:
            array = np.ascontiguousarray(array)
            pad = (-offset) % PARAM_ALIGNMENT
            f.write(b"\0" * pad)
            offset += pad
            f.write(array.tobytes())
            entries.append(TensorEntry(name, str(array.dtype), tuple(int(d) for d in array.shape),
                                       offset, array.nbytes))
            offset += array.nbytes
    return tuple(entries)


def prepare_out_dir(out_dir: Path) -> None:
    """Refuse to replace a folder that is not a Kiln artifact (never delete user data)."""
    if out_dir.exists():
        if not out_dir.is_dir():
            raise KilnError(f"{out_dir}: exists and is not a folder")
        if any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
            raise KilnError(f"{out_dir}: exists, is not empty and is not a Kiln artifact; choose another --out")


def write_artifact(
    out_dir: Path,
    build: Callable[[Path], tuple[Manifest, list[str]]],
) -> Path:
    """``build(tmp)`` writes every file into ``tmp`` and returns the manifest (without file
    entries) and the list of files it wrote; this hashes them, writes the manifest and
    moves the folder to ``out_dir``."""
    out_dir = Path(out_dir).resolve()
    prepare_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        manifest, files = build(tmp)
        entries = {name: FileEntry(sha256_file(tmp / name), (tmp / name).stat().st_size) for name in files}
        manifest = Manifest(**{**manifest.__dict__, "files": entries})
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


__all__ = ["write_params", "write_artifact", "LIBRARY_FILE", "PARAMS_FILE"]
