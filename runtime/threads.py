"""CPU threads for TVM kernels.

TVM's thread pool defaults to half the hardware threads, assuming two hyperthreads per
core; on machines without SMT (most cloud VMs: one vCPU per core) that leaves half the
cores idle. Kiln sizes the pool to the CPUs this process may run on, unless the user
chose (``TVM_NUM_THREADS``). Must run before the first kernel launch.
"""

from __future__ import annotations

import os


def configure_threads() -> None:
    if "TVM_NUM_THREADS" in os.environ:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["TVM_NUM_THREADS"] = str(cpus)
