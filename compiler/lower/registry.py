"""Kiln's ONNX -> Relax converters, one registry keyed by (domain, op_type).

A converter takes the conversion context, the onnx-ir node and its inputs already
converted to Relax expressions (``None`` for omitted optional inputs), and returns one
Relax expression per node output (a single expression for single-output ops).
Converters live in ``converters/``, one file per op family; importing that package
registers them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from kiln.runtime.errors import UnsupportedModelError

if TYPE_CHECKING:
    import onnx_ir as ir
    from tvm import relax

    from .context import ConvertContext

Converter = Callable[["ConvertContext", "ir.Node", Sequence["relax.Expr | None"]], object]

_REGISTRY: dict[tuple[str, str], Converter] = {}


def converter(*op_types: str, domain: str = ""):
    """Register the decorated function for each ONNX ``op_type`` in ``domain``."""

    def register(fn: Converter) -> Converter:
        for op_type in op_types:
            key = (domain, op_type)
            if key in _REGISTRY:
                raise RuntimeError(f"converter for {domain or 'ai.onnx'}::{op_type} registered twice")
            _REGISTRY[key] = fn
        return fn

    return register


def lookup(node: "ir.Node") -> Converter:
    from . import converters  # noqa: F401  (registers every converter)

    key = (node.domain or "", node.op_type)
    if key not in _REGISTRY:
        raise UnsupportedModelError(
            f"ONNX op {node.domain or 'ai.onnx'}::{node.op_type} (node {node.name!r}) has no Kiln converter"
        )
    return _REGISTRY[key]


def registered_ops() -> list[tuple[str, str]]:
    from . import converters  # noqa: F401

    return sorted(_REGISTRY)
