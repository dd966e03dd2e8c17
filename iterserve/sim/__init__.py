"""Simulator: the engine's own scheduler, policies and KV-cache manager (``iterserve.core``)
on a virtual clock, with a cost model in place of the model runner.

    iterserve simulate ...   (iterserve/sim/cli.py)
    iterserve profile ...    (iterserve/sim/profile.py): fit a cost profile of this machine
"""

from iterserve.sim.cost_model import (
    CostModel,
    ReplayCostModel,
    RooflineCostModel,
    StepShape,
    step_shape,
)
from iterserve.sim.hardware import HARDWARE, Efficiency, Hardware
from iterserve.sim.models import MODEL_TABLE, load_model_config
from iterserve.sim.simulator import SimConfig, SimResult, Simulator

__all__ = [
    "HARDWARE",
    "MODEL_TABLE",
    "CostModel",
    "Efficiency",
    "Hardware",
    "ReplayCostModel",
    "RooflineCostModel",
    "SimConfig",
    "SimResult",
    "Simulator",
    "StepShape",
    "load_model_config",
    "step_shape",
]
