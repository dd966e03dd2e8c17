"""Scheduling core: requests, the paged KV-cache accounting and the scheduler.

Pure Python (no torch) so it runs in unit tests, in the simulator and in micro-benchmarks.
"""

from iterserve.core.block_pool import BlockPool
from iterserve.core.kv_cache_manager import KVCacheManager
from iterserve.core.request import FinishReason, Request, RequestStatus
from iterserve.core.scheduler import Scheduler, SchedulerOutput

__all__ = [
    "BlockPool",
    "FinishReason",
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
]
