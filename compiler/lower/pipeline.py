"""The Relax pass pipeline, per target: legalize and fuse, then schedule every kernel
(MetaSchedule records where a database is given, dlight default rules for the rest),
then lower to the VM.
"""

from __future__ import annotations

import contextlib

import tvm
from tvm import relax
from tvm.relax import transform as T

from .noalias import mark_noalias
from .schedule_rules import default_rules


def fusion_passes() -> list[tvm.transform.Pass]:
    """Legalize and fuse: after these, every kernel is the PrimFunc that gets scheduled
    (what ``kiln tune`` extracts its tasks from)."""
    return [
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        # x @ permute_dims(W) -> one "NT" matmul reading W [N, K] in place.
        T.FuseTransposeMatmul(),
        T.LegalizeOps(),
        T.AnnotateTIROpPattern(),
        T.FoldConstant(),
        T.FuseOps(),
        T.FuseTIR(),
        T.DeadCodeElimination(),
    ]


def relax_pipeline(target: tvm.target.Target, database=None) -> tvm.transform.Pass:
    from tvm.s_tir import dlight as dl

    kind = target.kind.name

    @tvm.transform.module_pass(opt_level=0, name="KilnPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        # MetaScheduleApplyDatabase reads the target and the database from the context
        # when it is constructed, not only when it runs.
        with target, (database if database is not None else contextlib.nullcontext()):
            return tvm.transform.Sequential(_passes())(mod)

    def _passes() -> list[tvm.transform.Pass]:
        passes = fusion_passes()
        if database is not None:
            passes.append(T.MetaScheduleApplyDatabase())
        passes += [
            dl.ApplyDefaultSchedule(*default_rules(kind)),
            T.RewriteDataflowReshape(),
            T.ToNonDataflow(),
            T.RemovePurityChecking(),
            T.CallTIRRewrite(),
            T.StaticPlanBlockMemory(),
        ]
        if kind == "cuda":
            passes.append(T.RewriteCUDAGraph())
        passes += [
            T.LowerAllocTensor(),
            T.KillAfterLastUse(),
            T.LowerRuntimeBuiltin(),
            T.ComputePrimValue(),
            T.VMShapeLower(),
            T.AttachGlobalSymbol(),
            mark_noalias,  # after every kernel exists (the KV cache's included)
        ]
        return passes

    return _pipeline
