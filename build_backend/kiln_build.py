"""Kiln's build backend: setuptools' (every hook unchanged), plus one file in editable wheels.

setup.py maps compiler/, runtime/, cli/, bench/ onto ``kiln.*``, so an editable install is
setuptools' meta path finder (``__editable___kiln_llm_*_finder``), which its .pth file
*appends* to ``sys.meta_path``: behind the PathFinder that scans sys.path. ``python -m`` /
``-c`` / the REPL put the current directory first on sys.path, and a ``kiln`` folder there
without an ``__init__.py`` (a folder of artifacts, say) wins ``import kiln`` as an empty
namespace package: ``kiln.__version__`` is missing, ``kiln.runtime`` turns into the folder's
``runtime/`` if it has one (pypa/setuptools#3557). A regular install has no such problem: a
regular package anywhere on sys.path beats a namespace folder.

So the editable wheel also gets ``kiln_llm-editable-finder-first.pth``, which installs the
finder (idempotent; setuptools' own .pth calls the same ``install()``) and moves it to the
front of ``sys.meta_path``. The finder answers only for ``kiln`` and ``kiln.<child>``, from
the source folders, which is what an editable install means. Wheels without that finder
(``--config-settings editable_mode=strict``, regular wheels) are left as they are.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import tempfile
import zipfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the other PEP 517/660 hooks)

FINDER_FIRST_PTH = "kiln_llm-editable-finder-first.pth"
_FINDER = re.compile(r"(__editable___kiln_llm_\w+_finder)\.py")


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    _put_finder_first(Path(wheel_directory) / name)
    return name


def _put_finder_first(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        entries = [(info, zf.read(info)) for info in zf.infolist()]
    finders = [m.group(1) for info, _ in entries if (m := _FINDER.fullmatch(info.filename))]
    if not finders:
        return
    module = finders[0]
    pth = (f"import sys, {module}; {module}.install(); "
           f"sys.meta_path.sort(key=lambda finder: getattr(finder, '__module__', None) != '{module}')\n").encode()
    digest = base64.urlsafe_b64encode(hashlib.sha256(pth).digest()).rstrip(b"=").decode()
    fd, tmp = tempfile.mkstemp(dir=wheel.parent, suffix=".whl")
    os.close(fd)
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info, data in entries:
            if info.filename.endswith(".dist-info/RECORD"):
                data = data.rstrip(b"\n") + f"\n{FINDER_FIRST_PTH},sha256={digest},{len(pth)}\n".encode()
            out.writestr(info, data)
        out.writestr(FINDER_FIRST_PTH, pth)
    os.replace(tmp, wheel)
