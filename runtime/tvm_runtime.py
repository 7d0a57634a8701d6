"""Import TVM as a *runtime*: ``TVM_USE_RUNTIME_LIB=1`` makes ``import tvm`` load only
``libtvm_runtime`` (no compiler library, no relax/TIR Python packages). A process that
already imported the full TVM (the compiler, tests) keeps it: the runtime API is the same.
"""

from __future__ import annotations

import os

from .threads import configure_threads  # noqa: E402

os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
configure_threads()

import tvm  # noqa: E402
from tvm.runtime.vm import VirtualMachine  # noqa: E402

__all__ = ["tvm", "VirtualMachine"]
