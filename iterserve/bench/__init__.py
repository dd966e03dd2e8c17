"""Benchmarks: the OpenAI streaming client, offline comparisons, sweeps, plots and the CLI.

Workloads, timing, summaries and the in-process replay driver live in ``iterserve.workload``
(shared with the simulator).
"""
