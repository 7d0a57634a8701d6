"""The Relax pass pipeline, per target: legalize and fuse, then schedule every kernel
(MetaSchedule records where a database is given, dlight default rules for the rest),
then lower to the VM.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import transform as T

from .schedule_rules import default_rules


def relax_pipeline(target: tvm.target.Target, database=None) -> tvm.transform.Pass:
    from tvm.s_tir import dlight as dl

    kind = target.kind.name

    @tvm.transform.module_pass(opt_level=0, name="KilnPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        passes = [
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
        ]
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
