"""Weight-only quantization schemes: the single list the CLI offers and the artifact
manifest records.

A scheme says how the 2-D projection / LM-head / embedding weights are stored; activations,
norms, biases and the KV cache stay float32. The rewrite itself is
``kiln.compiler.passes.quantize_weights`` (standard ONNX ``DequantizeLinear`` / ``Cast`` of the stored
weight), so onnxruntime can still run the quantized graph as an oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("float", "fp16", "int8", "int4")


@dataclass(frozen=True)
class QuantScheme:
    """One storage scheme for weights.

    kind:  "float" (weights stay float32, no rewrite), "fp16" (float16 copy, Cast back to
           float32), "int8" (symmetric per block of ``group_size`` consecutive input
           features of each output row: w = q * scale, q in [-127, 127], as GGUF's Q8_0),
           "int4" (asymmetric per block: w = minimum + q * scale, q in [0, 15], as GGUF's
           Q4_1). Scales and minima are float16-exact (stored as float32 in ONNX).
    group_size: the block length along the reduction axis; None for float kinds.

    An int4 scheme stores only the projections in int4: the token embedding and the LM
    head (``table``) take int8, as llama.cpp's 4-bit formats keep them at 6-8 bits. On the
    default model int4 tables alone cost 18% top-1 agreement; int8 ones nothing measurable.
    """

    name: str
    kind: str
    group_size: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"QuantScheme {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in ("int8", "int4"):
            if not isinstance(self.group_size, int) or self.group_size <= 0:
                raise ValueError(f"QuantScheme {self.name!r}: {self.kind} needs a positive group_size")
        elif self.group_size is not None:
            raise ValueError(f"QuantScheme {self.name!r}: only int8 and int4 take a group_size")

    @property
    def table(self) -> QuantScheme:
        """The scheme of the embedding table and the LM head."""
        return SCHEMES["int8"] if self.kind == "int4" else self


# Order matters: it is the order of the CLI's choices (fp32 first: the default).
SCHEMES: dict[str, QuantScheme] = {
    s.name: s for s in (
        QuantScheme("fp32", "float"),
        QuantScheme("fp16", "fp16"),
        QuantScheme("int8", "int8", 32),
        QuantScheme("int4-g32", "int4", 32),
        QuantScheme("int4-g64", "int4", 64),
        QuantScheme("int4-g128", "int4", 128),
    )
}


@dataclass(frozen=True)
class QuantConfig:
    """What to quantize: every projection (q/k/v/o, gate/up/down) always; the token
    embedding table and the LM head only when ``embedding`` / ``lm_head`` (they are the
    largest matrices of small models and the most sensitive to error). For a tied
    embedding/LM head the two flags still apply to each consumer separately."""

    scheme: QuantScheme
    embedding: bool = True
    lm_head: bool = True
    # "int8": the inputs of int8 / int4-weight matmuls are quantized per row and block of 16
    # (symmetric) and multiplied with integer dot products (W8A8 / W4A8; CPUs with AVX-512 VNNI or AVX2).
    activations: str = "float32"

    def __post_init__(self):
        if not isinstance(self.scheme, QuantScheme):
            raise TypeError(f"QuantConfig.scheme must be a QuantScheme, got {type(self.scheme).__name__}")
        if SCHEMES.get(self.scheme.name) != self.scheme:
            raise ValueError(f"QuantConfig: unknown scheme {self.scheme!r}; choose one of {list(SCHEMES)}")
        for flag in ("embedding", "lm_head"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"QuantConfig.{flag} must be a bool")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"QuantConfig.activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        if self.activations == "int8" and not (self.scheme.kind == "int8" or (
                self.scheme.kind == "int4" and self.scheme.group_size % 16 == 0)):
            raise ValueError(f"int8 activations need int8 or int4 weights (--quant w8a8 / w4a8); {self.scheme.name} "
                             "keeps float32 activations")

    @property
    def is_float(self) -> bool:
        return self.scheme.kind == "float"

    @property
    def name(self) -> str:
        """The CLI name: the scheme's, or its W?A8 alias with int8 activations."""
        return next((a for a, (s, act) in ALIASES.items() if s == self.scheme.name and act == self.activations),
                    self.scheme.name)

    def describe(self) -> dict:
        """The manifest's record of the scheme (JSON-serializable)."""
        return {"scheme": self.scheme.name, "kind": self.scheme.kind, "group_size": self.scheme.group_size,
                "tables": self.scheme.table.name, "embedding": self.embedding, "lm_head": self.lm_head,
                "activations": self.activations}


ACTIVATIONS = ("float32", "int8")
# CLI names for a scheme with int8 activations: (scheme, activations).
ALIASES = {"w8a8": ("int8", "int8"), "w4a8": ("int4-g32", "int8")}
CHOICES = (*SCHEMES, *ALIASES)


def parse_quant(name: str, embedding: bool = True, lm_head: bool = True, activations: str | None = None) -> QuantConfig:
    """A CLI choice (``--quant int4-g32``, ``--quant w8a8``) -> its QuantConfig.
    ``activations`` overrides the alias's (``--quant w8a8 --act float32`` is int8)."""
    scheme_name, default_act = ALIASES.get(name, (name, "float32"))
    scheme = SCHEMES.get(scheme_name)
    if scheme is None:
        raise ValueError(f"unknown quantization {name!r}; choose one of: {', '.join(CHOICES)}")
    return QuantConfig(scheme, embedding=embedding, lm_head=lm_head, activations=activations or default_act)


def quant_from_record(record: dict | None) -> QuantConfig:
    """The manifest's record (``QuantConfig.describe()``) -> its QuantConfig; fp32 when absent."""
    if not record:
        return parse_quant("fp32")
    return parse_quant(record["scheme"], embedding=bool(record.get("embedding", True)),
                       lm_head=bool(record.get("lm_head", True)), activations=record.get("activations", "float32"))
