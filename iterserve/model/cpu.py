"""What this CPU can do natively, and process settings the CPU runner needs to be fast."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
import statistics
import time

import torch

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def has_native(dtype: torch.dtype) -> bool:
    """True when this CPU multiplies ``dtype`` in hardware (AVX512-BF16 / AMX-FP16)."""
    if dtype == torch.float32:
        return True
    check = "_is_avx512_bf16_supported" if dtype == torch.bfloat16 else "_is_amx_fp16_supported"
    return bool(getattr(torch.cpu, check, lambda: False)())


@functools.cache
def needs_upcast(dtype: torch.dtype) -> bool:
    """True for a low-precision dtype this CPU only emulates: f32 compute is then faster."""
    return dtype != torch.float32 and not has_native(dtype)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library (glibc's malloc tunables live there), or None where none is found."""
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


@functools.cache
def tune_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 31) -> bool:
    """Keeps freed memory in glibc's heap instead of returning it to the OS.

    By default glibc serves every allocation above a (dynamic, 128 KiB to 32 MiB) threshold with
    fresh ``mmap`` pages and unmaps them on free, so a step's large temporaries (the gathered
    K/V of a decode window, the f32 copies of activations) page-fault and get zeroed by the
    kernel on every step. Measured here, converting a 25 MB bf16 tensor to f32 took 12.4 ms with
    the defaults and 1.8 ms with these settings. Returns False where there is no glibc.
    """
    libc = _libc()
    if libc is None:
        return False
    try:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    except AttributeError:  # a C library without mallopt
        return False
    if not ok:
        logger.warning(
            "mallopt refused the allocator settings; large per-step temporaries will page-fault"
        )
    return ok


def trim_heap() -> bool:
    """Hands the free pages inside glibc's heap back to the OS (``malloc_trim(0)``). Once at
    start: packed weights and the KV cache live in mappings of their own (``empty_hugepages``),
    so the checkpoint tensors they replaced leave free heap memory that nothing reuses, and
    ``tune_allocator``'s trim threshold keeps it (docs/SPEED.md, "Huge pages for the KV cache").
    False where there is no glibc."""
    libc = _libc()
    if libc is None:
        return False
    try:
        libc.malloc_trim(0)
    except AttributeError:  # not glibc
        return False
    return True


_HUGE_PAGE = 2 << 20


def hugepages_wanted() -> bool:
    """``ITERSERVE_HUGEPAGES`` (default 1): 0 keeps the kernel's default pages (for A/B runs)."""
    v = os.environ.get("ITERSERVE_HUGEPAGES", "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"ITERSERVE_HUGEPAGES must be 0 or 1, got {v!r}")
    return v == "1"


def empty_hugepages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor that starts on a 2 MiB boundary of an anonymous mapping of its own,
    which Linux is asked to back with 2 MiB pages (``madvise(MADV_HUGEPAGE)``; it applies where
    transparent huge pages are in ``madvise`` mode, the common default). The paged KV cache
    wants them: a decode reads each sequence's blocks scattered over the pool, 4 KiB pages make
    nearly every block a TLB miss, and the hardware prefetchers stop at 4 KiB page ends
    (docs/SPEED.md, "Huge pages for the KV cache"). Its own mapping, not glibc's heap: advice
    given to a range of the heap did not always stay on it. The mapping is rounded up to whole
    2 MiB pages (at most 4 MiB more than the tensor). Below 2 MiB, where madvise is unavailable,
    or with ``ITERSERVE_HUGEPAGES=0``: a plain ``torch.zeros``."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not hugepages_wanted() or nbytes < _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE + _HUGE_PAGE  # room to start on a boundary
    # private: a shared anonymous mapping is shmem, where THP has its own (usually off) switch
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # THP compiled out: small pages, same tensor
        logger.debug("madvise(MADV_HUGEPAGE) failed: %s", exc)
    view = ctypes.c_char.from_buffer(mm)
    offset = -ctypes.addressof(view) % _HUGE_PAGE
    del view  # a buffer export; the tensor below holds its own
    t = torch.frombuffer(mm, dtype=dtype, count=math.prod(shape), offset=offset)
    # Touched now, as torch.zeros would: a pool too big for the machine fails at start, not
    # when serving first reaches its far blocks.
    return t.view(shape).zero_()


def available_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (torch's
    default thread count is the machine's physical cores, which ignores both)."""
    n = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


def other_runnable(samples: int = 5, interval_s: float = 0.005) -> float:
    """Tasks running machine-wide besides the caller: the median of ``procs_running`` in
    /proc/stat over a few samples, less one (NaN where there is no /proc/stat)."""
    seen: list[int] = []
    for i in range(samples):
        try:
            with open("/proc/stat") as f:
                seen += [int(ln.split()[1]) - 1 for ln in f if ln.startswith("procs_running")]
        except (OSError, ValueError):
            return math.nan
        if i + 1 < samples:
            time.sleep(interval_s)
    return float(statistics.median(seen)) if seen else math.nan


def setup_threads(num_threads: int | None) -> int:
    """Sets torch's intra-op threads at engine start and logs what it sees: ``num_threads`` if
    given, else ``OMP_NUM_THREADS`` if set (torch already took it), else the cores this process
    may use (``available_cores``). The count fixed here is the start: ``ThreadGovernor`` fits a
    count iterserve chose to the cores other processes leave free while the engine steps. A
    warning says when threads wait actively on a busy machine. Returns the thread count."""
    import iterserve

    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(
                f"num_threads must be >= 1 (or None for the cores available), got {num_threads}"
            )
        threads, why = num_threads, "num_threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        threads, why = torch.get_num_threads(), "OMP_NUM_THREADS"
    else:
        threads, why = min(torch.get_num_threads(), available_cores()), "cores available"
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    policy = os.environ.get("OMP_WAIT_POLICY", "unset (libgomp spins, then sleeps)")
    if iterserve.OMP_WAIT_POLICY_SET:
        os.environ.pop("OMP_WAIT_POLICY", None)  # read by libgomp already; not for children
        policy = "PASSIVE (iterserve's default)"
    if iterserve.GOMP_SPINCOUNT_SET:
        os.environ.pop("GOMP_SPINCOUNT", None)
        policy += f", after {iterserve.OMP_SPIN_COUNT} spins (iterserve's default)"
    elif os.environ.get("GOMP_SPINCOUNT"):
        policy += f", GOMP_SPINCOUNT {os.environ['GOMP_SPINCOUNT']}"
    others = other_runnable()
    logger.info(
        "torch threads: %d (%s; %d cores available, %s other tasks running); OMP_WAIT_POLICY %s",
        threads,
        why,
        available_cores(),
        "?" if math.isnan(others) else f"{others:.0f}",
        policy,
    )
    if (
        threads > 1
        and others >= 1
        and not iterserve.OMP_WAIT_POLICY_SET
        and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"
    ):
        logger.warning(
            "OpenMP threads wait actively on a machine with other work: throughput can collapse "
            "(docs/SPEED.md, Contention); set OMP_WAIT_POLICY=PASSIVE before start, or import "
            "iterserve before torch"
        )
    return threads


def _machine_busy_s() -> float:
    """CPU seconds spent busy machine-wide since boot (all CPUs; /proc/stat's first line, idle
    and iowait left out); NaN where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return math.nan
    if not fields or fields[0] != "cpu":
        return math.nan
    jiffies = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(jiffies) - jiffies[3] - jiffies[4]
    return busy / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """The cores other processes kept busy since it was made (or last reset): the machine's busy
    CPU time (/proc/stat) less this process's own, per second of wall time."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._busy0 = _machine_busy_s()
        self._own0 = time.process_time()

    def cores(self, reset: bool = False) -> float:
        """Other processes' cores since the start (NaN where unknown); ``reset``: start anew."""
        now = time.monotonic()
        busy, own = _machine_busy_s(), time.process_time()
        wall = now - self.started
        others = (busy - self._busy0 - (own - self._own0)) / wall if wall > 0 else math.nan
        if reset:
            self.started, self._busy0, self._own0 = now, busy, own
        return others


class ThreadGovernor:
    """Fits torch's threads to the cores other processes leave free, at run time.

    Every ``interval_s`` of stepping it reads the CPU time the whole machine spent busy and the
    time this process spent; what others took, in cores, leaves ``cores - others`` for us. An
    OpenMP team wider than the free cores waits at every barrier for a thread that queues behind
    the other process (on a 2-core VM beside one busy process, one thread kept 522 tok/s and two
    ~330-430; docs/SPEED.md, "Spin count and thread count against a busy process"), so the
    team shrinks to the free cores, and grows back when they free up. ``tick`` is called by the
    thread that runs the forward passes (OpenMP's thread count is that thread's setting)."""

    def __init__(self, max_threads: int, interval_s: float = 0.5) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self.interval_s = interval_s
        self.changes = 0
        self._load = OtherLoad()

    def decide(self, others: float) -> int:
        """The thread count for ``others`` cores taken by other processes: shrink when the free
        cores fall 0.4 below the threads, grow when they rise 0.7 above (hysteresis, so that
        noise in one window does not flip it)."""
        free = self.max_threads - max(0.0, others)
        if free < self.threads - 0.4:
            return max(1, math.floor(free + 0.4))
        if free > self.threads + 0.7:
            return min(self.max_threads, math.floor(free + 0.3))
        return self.threads

    def tick(self) -> int:
        """Re-decides once a window has passed; returns the thread count in force."""
        if time.monotonic() - self._load.started < self.interval_s:
            return self.threads
        others = self._load.cores(reset=True)
        if math.isnan(others):
            return self.threads
        n = self.decide(others)
        if n != self.threads:
            logger.info(
                "torch threads %d -> %d: other processes took %.2f of %d cores",
                self.threads, n, others, self.max_threads,
            )  # fmt: skip
            self.threads = n
            self.changes += 1
            torch.set_num_threads(n)
        return self.threads


def thread_governor(threads: int, num_threads: int | None) -> ThreadGovernor | None:
    """A ``ThreadGovernor`` where the thread count was iterserve's choice (no ``num_threads``,
    no OMP_NUM_THREADS) and more than one: a count the user fixed stays fixed.
    ``ITERSERVE_ADAPT_THREADS=0`` turns it off."""
    if (
        threads < 2
        or num_threads is not None
        or os.environ.get("OMP_NUM_THREADS")
        or os.environ.get("ITERSERVE_ADAPT_THREADS", "1").strip().lower()
        in ("0", "off", "false", "no")
        or math.isnan(_machine_busy_s())
    ):
        return None
    return ThreadGovernor(threads)
