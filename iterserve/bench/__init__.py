"""Benchmarks: workloads (datasets), metrics, the OpenAI streaming client, the in-process
replay driver, offline comparisons, sweeps and plots.

``datasets`` and ``metrics`` import neither torch nor an HTTP library, so the simulator can
reuse them; ``replay``/``offline``/``sweep`` drive an in-process ``LLMEngine``; ``client``
talks to any OpenAI-compatible server.
"""
