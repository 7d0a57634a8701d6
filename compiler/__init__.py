"""kiln.compiler: model -> ONNX -> passes -> TVM Relax -> kernels -> artifact.

The compiler needs the *full* TVM (relax, TIR, codegen). ``kiln.runtime`` imports TVM
runtime-only (``TVM_USE_RUNTIME_LIB=1``) and TVM cannot switch within a process, so the
compiler loads the full library first when it can, and says so clearly when it cannot.
"""

import os as _os
import sys as _sys

from kiln.runtime.threads import configure_threads as _configure_threads

_configure_threads()

if "tvm" not in _sys.modules:
    if _os.environ.get("TVM_USE_RUNTIME_LIB") == "1":
        del _os.environ["TVM_USE_RUNTIME_LIB"]  # inherited from a runtime process: not for us
    import tvm as _tvm  # noqa: F401
elif _sys.modules["tvm"].base._RUNTIME_ONLY:
    raise ImportError(
        "kiln.compiler needs the full TVM library, but this process already loaded TVM "
        "runtime-only (kiln.runtime was imported first); import kiln.compiler before kiln.runtime"
    )
