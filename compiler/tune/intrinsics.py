"""Import TVM's tensor intrinsics (which MetaSchedule needs) in seconds, not minutes.

``tvm.s_tir.tensor_intrin`` defines some hundreds of TVMScript functions; each definition
calls ``inspect.stack()``, which resolves the source file of every frame on the stack, and
each resolution copies ``sys.modules``. In a process that has imported torch (thousands of
modules) under a deep caller such as pytest, that import ran for minutes. TVMScript reads
the source line of the third frame and the locals of the rest, so during this one import
the stack is built with source context for the first three frames only.
"""

from __future__ import annotations

import inspect
import sys

_CONTEXT_FRAMES = 3


def _shallow_stack(context: int = 1) -> list[inspect.FrameInfo]:
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        if len(frames) < _CONTEXT_FRAMES:
            frames.append(inspect.FrameInfo(frame, *inspect.getframeinfo(frame, context)))
        else:
            code = frame.f_code
            frames.append(inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, None, None))
        frame = frame.f_back
    return frames


def import_tensor_intrinsics() -> None:
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    original = inspect.stack
    inspect.stack = _shallow_stack
    try:
        import tvm.s_tir.tensor_intrin  # noqa: F401
    finally:
        inspect.stack = original
