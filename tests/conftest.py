"""The suite runs the fixed CPU-flag kernel rules unless told otherwise: measuring the paths at
each new shape would cost every test start time and make its path depend on the machine's load.
Measurement itself, and every path it can pick, are tested explicitly (test_autotune.py; the
ITERSERVE_KERNELS=gemm=... cases in test_model.py and test_backends.py)."""

import os

os.environ.setdefault("ITERSERVE_KERNELS", "flags")
# What `import iterserve` would set if it came before torch (iterserve/__init__.py): the suite
# runs on shared machines, where actively waiting OpenMP threads slow every step many times.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
