"""What bench and sim share: workloads (``datasets``: ``RequestSpec``, the shipped traces),
per-request timing and summaries (``metrics``), result files (``results``) and the in-process
driver that times an engine (``replay``).

``datasets``, ``metrics`` and ``results`` import neither torch nor an HTTP library, so the
simulator can use them without loading a model.
"""
