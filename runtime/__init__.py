"""kiln.runtime: load an artifact with the TVM runtime only, and generate.

``Engine`` (and the other public names) load lazily: importing a light submodule such as
``kiln.runtime.errors`` must not load TVM, because the compiler needs to load the full
TVM library first in processes that also compile.
"""

_LAZY = {
    "Engine": "engine", "EngineConfig": "engine", "EngineOverloadedError": "engine",
    "EngineUnavailableError": "engine", "EngineStats": "core",
    "Completion": "outputs", "Choice": "outputs", "Delta": "outputs",
    "SamplingParams": "sampling",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
