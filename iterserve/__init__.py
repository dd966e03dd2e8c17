"""iterserve: an LLM serving engine built around iteration-level (continuous) batching."""

import os
import sys
from typing import TYPE_CHECKING

from iterserve.config import EngineArgs
from iterserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepStats
from iterserve.sampling_params import SamplingParams

# OpenMP threads that spin at barriers hold their core while the thread they wait for queues
# behind another process: with one busy process beside it on 2 cores, bench-134m's decode
# throughput fell ~20x with libgomp's default waiting (spin ~300k times, then sleep), not with
# passive waiting (docs/SPEED.md, "Contention"). Passive waiting with no spin at all costs
# ~25% on a quiet machine, paid at the ~100 barriers of every decode step, and more in a VM
# where waking a sleeping vCPU takes ~80 us; a short spin (GOMP_SPINCOUNT; 1,000 spins covered
# gaps of 5 us but not 20 us on an AMX Xeon VM, 10,000 ~150 us) catches the next parallel
# region on a quiet machine and gives the core up soon when it is shared, where the engine also
# fits its thread count to the cores left free (``cpu.ThreadGovernor``). libgomp reads both
# once, when torch loads, so they only take effect when iterserve is imported first; a value the
# user set wins. The engine takes them out of the environment again at start
# (``cpu.setup_threads``) so child processes get their own defaults.
OMP_SPIN_COUNT = 10_000
OMP_WAIT_POLICY_SET = "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules
GOMP_SPINCOUNT_SET = OMP_WAIT_POLICY_SET and "GOMP_SPINCOUNT" not in os.environ
if OMP_WAIT_POLICY_SET:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
if GOMP_SPINCOUNT_SET:
    os.environ["GOMP_SPINCOUNT"] = str(OMP_SPIN_COUNT)

if TYPE_CHECKING:  # imported lazily below at run time (torch is heavy)
    from iterserve.engine import LLM, LLMEngine

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StepStats",
]


def __getattr__(name: str) -> object:
    # The engine pulls in torch; keep `import iterserve` (and iterserve.core) light.
    if name in ("LLM", "LLMEngine"):
        from iterserve import engine

        return getattr(engine, name)
    raise AttributeError(name)
