"""ModelRunner: the only owner of tensors, devices and the paged KV-cache buffers.

CONTRACT (the engine relies on exactly this):

    runner = ModelRunner(model_path, dtype="float32", cache_config=CacheConfig(...),
                         max_model_len=None, seed=0, num_threads=None,
                         attention_backend=None)
    runner.num_kv_blocks   # int: blocks in the pool (cache_config.num_kv_blocks, or sized
                           # from cache_config.kv_cache_memory // bytes per block)
    runner.block_size      # int
    runner.max_model_len   # int: min(user value, config max_position_embeddings)
    runner.vocab_size      # int
    runner.eos_token_ids   # list[int] from generation_config.json / config.json
    runner.model_path      # str: folder holding config.json, weights and tokenizer files
    logits = runner.execute(items)   # float32 [num items with need_logits, vocab_size]

    Also: runner.reset_kv_cache() (zero fill after a failed step), runner.kv_bytes_per_block,
    runner.num_layers, runner.num_params, runner.hf_config (config.json as a dict),
    runner.model_config (the parsed ``ModelConfig``) and runner.attention (the attention
    backend, chosen once here from ``attention_backend``, else ``ITERSERVE_ATTENTION_BACKEND``:
    attention_backends.py).
    A built-in name (``tiny-random``) is accepted as model_path and resolved to its folder.

Each ``BatchItem`` asks to compute the KV of ``token_ids`` at positions
``start_pos .. start_pos + len(token_ids) - 1`` for one sequence, whose earlier positions
are already in the cache at the slots its ``block_table`` names (slot of position p:
``block_table[p // block_size] * block_size + p % block_size``). Prefill chunks and decodes of
many sequences run in ONE forward over the flattened tokens. Within each layer, ALL new K/V
of the step are written to the cache before any attention reads it (so two sequences that
share prefix blocks within one step see each other's writes).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from iterserve import config
from iterserve.config import CacheConfig
from iterserve.model import kernels
from iterserve.model.attention import StepItem
from iterserve.model.attention_backends import (
    AttentionBackend,
    StepMetadata,
    backend_setting,
    select_backend,
)
from iterserve.model.builtin import resolve_model
from iterserve.model.cpu import needs_upcast, tune_allocator
from iterserve.model.layers import packing_available
from iterserve.model.llama import DecoderModel, RotaryTable, Strategies
from iterserve.model.loader import load_weights
from iterserve.model.model_config import ModelConfig

logger = logging.getLogger(__name__)


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# The names live in one place (iterserve.config); each is also torch's attribute name.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in config.DTYPES}


@dataclass
class BatchItem:
    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_logits: bool


class ModelRunner:
    """Owns the model weights, the RoPE table and the paged KV cache; runs one step per call."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        cache_config: CacheConfig = CacheConfig(),  # noqa: B008 (frozen, so sharing is safe)
        max_model_len: int | None = None,
        seed: int = 0,
        num_threads: int | None = None,
        attention_backend: str | None = None,
    ) -> None:
        """``attention_backend``: auto|torch|cpu|triton; None reads ITERSERVE_ATTENTION_BACKEND
        (default auto)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(
                    f"num_threads must be >= 1 (or None for torch's default), got {num_threads}"
                )
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.model_path: str = resolve_model(model_path)
        self.model_config = cfg = ModelConfig.from_pretrained(self.model_path)
        self.hf_config: dict[str, Any] = cfg.hf_config
        self.dtype: torch.dtype = DTYPES[dtype]
        self.vocab_size: int = cfg.vocab_size
        self.eos_token_ids: list[int] = list(cfg.eos_token_ids)
        self.num_layers: int = cfg.num_layers
        self.max_model_len: int = min(
            max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")

        tune_allocator()
        with torch.inference_mode():
            self.model = DecoderModel(cfg, self.dtype)
            load_weights(self.model, self.model_path)
            self.rope = RotaryTable(cfg.head_dim, cfg.rope, self.max_model_len, self.dtype)
        self.num_params: int = sum(p.numel() for p in self.model.parameters())  # tied counted once
        self.device = torch.device("cpu")
        self.packed_weights: bool = self._should_pack()
        # iterserve's C++ kernels, built the first time on this machine (a few seconds), loaded
        # here rather than in the first step; None: torch's kernels (see kernels.py).
        t0 = time.perf_counter()
        kern = kernels.load()
        if kern is not None:
            logger.info("C++ kernels ready in %.1f s", time.perf_counter() - t0)
        self.kernels: kernels.Kernels | None = kern  # also the sampler's (see LLMEngine.step)
        self.attention: AttentionBackend[Any] = select_backend(
            attention_backend or backend_setting(), self.dtype, self.device, kern
        )
        logger.info("attention backend: %s", self.attention.name)
        upcast = needs_upcast(self.dtype)
        # bf16 on a CPU that emulates it: panels serve up to PANEL_MAX_ROWS rows and replace the
        # bf16 originals; the packed f32 copy, where it fits, serves more rows (layers.py).
        panel_kern = kern if self.dtype == torch.bfloat16 and upcast else None
        self.panel_weights: bool = panel_kern is not None
        strategies = Strategies(
            attention=self.attention,
            pack=self.packed_weights,
            upcast=upcast,
            panel_kern=panel_kern,
            fused=kern if self.dtype == torch.bfloat16 else None,
        )
        with torch.inference_mode():
            self.model.select_strategies(strategies)

        self.block_size: int = cache_config.block_size
        elem = torch.tensor([], dtype=self.dtype).element_size()
        self.kv_bytes_per_block: int = (
            2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem
        )
        self.num_kv_blocks: int = (
            cache_config.num_kv_blocks or cache_config.kv_cache_memory // self.kv_bytes_per_block
        )
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={cache_config.kv_cache_memory} bytes holds no KV block: one "
                f"block of {self.block_size} tokens needs {self.kv_bytes_per_block} bytes for "
                "this model; raise kv_cache_memory or lower block_size"
            )
        # Allocated once; zero-filled (not empty) because padded decode windows read unused slots
        # with a zero attention weight, and 0 * NaN garbage would still be NaN.
        slots = self.num_kv_blocks * self.block_size
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(slots, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype),
                torch.zeros(slots, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype),
            )
            for _ in range(cfg.num_layers)
        ]

    def _should_pack(self) -> bool:
        """Prepack GEMM weights as f32 (``PackedLinear``) for f32 models, and for bf16/f16 ones
        on CPUs that only emulate them when the f32 copy takes at most half the free memory.
        ``ITERSERVE_PACK_WEIGHTS=0`` / ``=1`` forces it off / on."""
        env = os.environ.get("ITERSERVE_PACK_WEIGHTS", "auto").strip().lower()
        if env not in ("0", "1", "auto"):
            raise ValueError(f"ITERSERVE_PACK_WEIGHTS must be 0, 1 or auto, got {env!r}")
        if env == "0" or not packing_available():
            return False
        if env == "1" or self.dtype == torch.float32:
            return True
        if not needs_upcast(self.dtype):
            return False
        need = self.model.linear_weight_bytes()
        free = _available_memory()
        if free is not None and need > free // 2:
            logger.info(
                "not packing weights: their f32 copy (%d MB) exceeds half the free memory",
                need >> 20,
            )
            return False
        return True

    def reset_kv_cache(self) -> None:
        """Zero every slot (after a failed step, whose partial writes must not leak)."""
        for k, v in self.kv_caches:
            k.zero_()
            v.zero_()

    def execute(self, items: Sequence[BatchItem]) -> torch.Tensor:
        """Runs one forward over all items; float32 logits [num items with need_logits, vocab],
        in the order those items appear in ``items`` (for each, the logits of its last token)."""
        if not items:
            return torch.empty(0, self.vocab_size)
        bs = self.block_size
        # Decode-first row order (see attention.py): one batched call for all single-token items.
        order = [i for i, it in enumerate(items) if len(it.token_ids) == 1]
        num_decodes = len(order)
        order += [i for i, it in enumerate(items) if len(it.token_ids) != 1]
        ids: list[int] = []
        positions: list[int] = []
        step_items: list[StepItem] = []
        last_row = [0] * len(items)
        for i in order:
            it = items[i]
            n, p0 = len(it.token_ids), it.start_pos
            if n == 0 or p0 < 0 or p0 + n > self.max_model_len:
                raise ValueError(
                    f"request {it.request_id}: positions [{p0}, {p0 + n}) must be non-empty and "
                    f"within [0, max_model_len={self.max_model_len})"
                )
            if len(it.block_table) * bs < p0 + n:
                raise ValueError(
                    f"request {it.request_id}: block_table has {len(it.block_table)} blocks of "
                    f"{bs} tokens, too few for position {p0 + n - 1}"
                )
            ids.extend(it.token_ids)
            positions.extend(range(p0, p0 + n))
            last_row[i] = len(ids) - 1
            step_items.append(StepItem(n, p0, it.block_table))
        logit_rows = [last_row[i] for i, it in enumerate(items) if it.need_logits]

        with torch.inference_mode():
            pos = torch.tensor(positions, dtype=torch.int64)
            cos, sin = self.rope.gather(pos)
            step = StepMetadata(
                step_items,
                num_decodes,
                bs,
                self.model_config.sliding_window,
                self.dtype,
                self.device,
            )
            return self.model(
                torch.tensor(ids, dtype=torch.int64),
                cos,
                sin,
                self.attention.build_metadata(step),  # once per step, shared by all layers
                self.kv_caches,
                torch.tensor(logit_rows, dtype=torch.int64),
            )
