"""ModelRunner: the only owner of tensors, devices and the paged KV-cache buffers.

CONTRACT (the engine relies on exactly this):

    runner = ModelRunner(model_path, dtype="float32", cache_config=CacheConfig(...),
                         max_model_len=None, seed=0, num_threads=None,
                         attention_backend=None, device="cpu", max_num_seqs=64,
                         max_num_batched_tokens=512, enforce_eager=False)
    runner.num_kv_blocks   # int: blocks in the pool (cache_config.num_kv_blocks, or sized
                           # from cache_config.kv_cache_memory // bytes per block, or on a
                           # GPU from cache_config.gpu_memory_utilization by profiling)
    runner.device          # torch.device: where weights, KV cache and logits live
    runner.block_size      # int
    runner.max_model_len   # int: min(user value, config max_position_embeddings)
    runner.vocab_size      # int
    runner.eos_token_ids   # list[int] from generation_config.json / config.json
    runner.model_path      # str: folder holding config.json, weights and tokenizer files
    logits = runner.execute(items)   # float32 [num items with need_logits, vocab_size]
    logits, prompt = runner.execute_with_prompt_logprobs(items)
                    # and {request_id: [TokenLogprobs per target]} for the items with
                    # prompt_targets

    Also: runner.reset_kv_cache() (zero fill after a failed step), runner.kv_bytes_per_block,
    runner.num_layers, runner.num_params, runner.hf_config (config.json as a dict),
    runner.model_config (the parsed ``ModelConfig``) and runner.attention (the attention
    backend, chosen once here from ``attention_backend``, else ``ITERSERVE_ATTENTION_BACKEND``:
    attention_backends.py).
    A built-in name (``tiny-random``) is accepted as model_path and resolved to its folder.

On CUDA (``device``: cpu|cuda|auto, device.py), decode-only steps replay CUDA graphs captured
at batch sizes up to ``max_num_seqs`` (cuda_graphs.py) unless ``enforce_eager``; every other
step runs eagerly. ``max_num_batched_tokens`` sizes the profiling forward of the memory budget.

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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from iterserve import config
from iterserve.config import CacheConfig, kv_block_cap
from iterserve.model import autotune, kernels
from iterserve.model.attention import KVCaches, StepItem
from iterserve.model.attention_backends import (
    AttentionBackend,
    CpuBackend,
    StepMetadata,
    TritonBackend,
    TritonMetadata,
    backend_setting,
    select_backend,
)
from iterserve.model.builtin import resolve_model
from iterserve.model.cpu import (
    ThreadGovernor,
    empty_hugepages,
    needs_upcast,
    setup_threads,
    thread_governor,
    trim_heap,
    tune_allocator,
)
from iterserve.model.cuda_graphs import DecodeGraphs, GraphInputs, capture_sizes
from iterserve.model.device import (
    GiB,
    GpuMemory,
    check_dtype,
    kv_pool_from_memory,
    resolve_device,
    to_device_int32,
)
from iterserve.model.layers import Linear, choose_act, gate_up_layout, packing_available
from iterserve.model.llama import DecoderLayer, DecoderModel, RotaryTable, Strategies
from iterserve.model.loader import load_weights
from iterserve.model.model_config import ModelConfig, check_not_quantized, context_length

if TYPE_CHECKING:
    from iterserve.model.sampler import TokenLogprobs

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


def _within_half_free(need: int, refusal: str) -> bool:
    """Whether a weight copy of ``need`` bytes takes at most half the free memory (else it logs
    ``refusal`` with the copy's MB); True where the free memory is unknown."""
    free = _available_memory()
    if free is not None and need > free // 2:
        logger.info(refusal, need >> 20)
        return False
    return True


# The names live in one place (iterserve.config); each is also torch's attribute name.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in config.DTYPES}


@dataclass
class BatchItem:
    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_logits: bool
    # Prompt logprobs: the tokens that follow this item's first len(prompt_targets) positions
    # (the next prompt tokens); their logprobs and the top ``prompt_top_k`` come back.
    prompt_targets: list[int] | None = None
    prompt_top_k: int = 0


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
        device: str = "cpu",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enforce_eager: bool = False,
    ) -> None:
        """``attention_backend``: auto|torch|cpu|triton; None reads ITERSERVE_ATTENTION_BACKEND
        (default auto: cpu kernels on CPU, triton on CUDA)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        self.num_threads: int = setup_threads(num_threads)
        torch.manual_seed(seed)
        self.model_path: str = resolve_model(model_path)
        self.model_config = cfg = ModelConfig.from_pretrained(self.model_path)
        check_not_quantized(cfg)
        self.hf_config: dict[str, Any] = cfg.hf_config
        self.dtype: torch.dtype = DTYPES[dtype]
        self.vocab_size: int = cfg.vocab_size
        self.eos_token_ids: list[int] = list(cfg.eos_token_ids)
        self.num_layers: int = cfg.num_layers
        self.max_model_len: int = context_length(max_model_len or None, cfg)
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")

        self.device: torch.device = resolve_device(device)
        check_dtype(self.device, self.dtype)
        # CPU threads fitted to the cores other processes leave free, step by step
        self.thread_governor: ThreadGovernor | None = (
            thread_governor(self.num_threads, num_threads) if self.device.type == "cpu" else None
        )
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.set_device(self.device)
            self._free_at_start, self._total_memory = torch.cuda.mem_get_info(self.device)
        tune_allocator()
        # Built and filled on the device (the loader copies from the safetensors on the host).
        with torch.inference_mode(), self.device:
            self.model = DecoderModel(cfg, self.dtype)
            load_weights(self.model, self.model_path)
            self.rope = RotaryTable(cfg.head_dim, cfg.rope, self.max_model_len, self.dtype)
        self.num_params: int = sum(p.numel() for p in self.model.parameters())  # tied counted once
        # iterserve's C++ kernels (CPU only), built the first time on this machine (a few
        # seconds), loaded here rather than in the first step; None: torch's (see kernels.py).
        setting = kernels.setting()
        kern = None
        if not on_cuda:
            t0 = time.perf_counter()
            kern = kernels.load()
            if kern is not None:
                logger.info("C++ kernels ready in %.1f s", time.perf_counter() - t0)
        self.kernels: kernels.Kernels | None = kern  # also the sampler's (see LLMEngine.step)
        self.attention: AttentionBackend[Any] = select_backend(
            attention_backend or backend_setting(), self.dtype, self.device, kern,
            self.model_config.head_dim,
        )  # fmt: skip
        fused = kern if self.dtype == torch.bfloat16 else None
        # The GEMM / decode paths measured here (autotune.py), or ITERSERVE_KERNELS=flags' rules.
        self.kernel_choice: autotune.Choice | None = None
        if on_cuda or setting.mode == "flags":
            upcast = not on_cuda and needs_upcast(self.dtype)
            self.packed_weights: bool = not on_cuda and self._pack_allowed(flags=True)
            # bf16 on a CPU that emulates it: panels serve up to PANEL_MAX_ROWS rows and replace
            # the bf16 originals; the packed f32 copy, where it fits, serves more rows.
            panel_kern = kern if self.dtype == torch.bfloat16 and upcast else None
            self.panel_weights: bool = panel_kern is not None
            strategies = Strategies(
                attention=self.attention,
                pack=self.packed_weights,
                upcast=upcast,
                panel_kern=panel_kern,
                fused=fused,
            )
        else:
            strategies = self._measured_strategies(
                setting, kern, fused, cache_config.block_size, max_num_batched_tokens
            )
        # 12-bit copies only where a pair GEMM can read them (flags' rules build none)
        want12 = (
            setting.w12 != "off"
            and setting.mode != "flags"
            and self.dtype == torch.bfloat16
            and kern is not None
            and kern.has_pairs12
        )
        layers12 = want12 and self._pairs12_fit(lm_head=False)
        strategies = replace(
            strategies,
            lm_screen=setting.lm_head != "full",
            pairs12=layers12,
            pairs12_head=layers12 and self._pairs12_fit(lm_head=True),
        )
        with torch.inference_mode():
            self.model.select_strategies(strategies)
        pf = getattr(self.attention, "prefill_kernel", False)  # after the kernel choice
        logger.info(
            "attention backend: %s on %s%s", self.attention.name, self.device,
            ", prefill through iterserve's kernel" if pf else "",
        )  # fmt: skip

        self.block_size: int = cache_config.block_size
        elem = torch.tensor([], dtype=self.dtype).element_size()
        self.kv_bytes_per_block: int = (
            2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem
        )
        self.max_num_seqs = max_num_seqs
        self.graphs: DecodeGraphs | None = None  # set after the pool (execute reads it)
        if cache_config.gpu_memory_utilization is not None and on_cuda:
            self.num_kv_blocks: int = self._blocks_from_gpu_memory(
                cache_config.gpu_memory_utilization, max_num_batched_tokens
            )
        else:
            self.num_kv_blocks = (
                cache_config.num_kv_blocks
                or cache_config.kv_cache_memory // self.kv_bytes_per_block
            )
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={cache_config.kv_cache_memory} bytes holds no KV block: one "
                f"block of {self.block_size} tokens needs {self.kv_bytes_per_block} bytes for "
                "this model; raise kv_cache_memory or lower block_size"
            )
        # Allocated once; zero-filled (not empty) because padded decode windows read unused slots
        # with a zero attention weight, and 0 * NaN garbage would still be NaN.
        self.kv_caches: KVCaches = self._allocate_kv(self.num_kv_blocks)
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens, %.3f GiB on %s",
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_blocks * self.block_size,
            self.num_kv_blocks * self.kv_bytes_per_block / GiB,
            self.device,
        )
        if on_cuda and not enforce_eager:
            self.graphs = self._decode_graphs(capture=True)
        if self.device.type == "cpu":
            trim_heap()  # the checkpoint's copies that packing replaced, freed in glibc's heap

    def _allocate_kv(self, num_blocks: int) -> KVCaches:
        cfg, slots = self.model_config, num_blocks * self.block_size
        shape = (slots, cfg.num_kv_heads, cfg.head_dim)

        def zeros() -> torch.Tensor:
            if self.device.type == "cpu":
                return empty_hugepages(shape, self.dtype)
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        return tuple((zeros(), zeros()) for _ in range(cfg.num_layers))

    # ---- GPU: memory budget and CUDA graphs -------------------------------------------------

    def _blocks_from_gpu_memory(self, utilization: float, max_num_batched_tokens: int) -> int:
        """vLLM's rule (device.kv_pool_from_memory) on this card's measured memory, capped at
        ``kv_block_cap`` (the rest of the budget then stays free)."""
        mem = self._measure_gpu_memory(max_num_batched_tokens)
        pool = kv_pool_from_memory(mem, utilization, self.kv_bytes_per_block, self.block_size)
        cap = kv_block_cap(self.max_num_seqs, self.max_model_len, self.block_size)
        logger.info(
            "GPU memory: %.2f GiB x gpu_memory_utilization %.2f = %.2f GiB; weights %.2f GiB, "
            "peak activations %.2f GiB, non-torch %.2f GiB -> %.2f GiB for the KV cache (%d "
            "blocks%s)",
            mem.total / GiB,
            utilization,
            pool.budget / GiB,
            mem.weights / GiB,
            mem.peak_activation / GiB,
            mem.non_torch / GiB,
            pool.kv_bytes / GiB,
            pool.num_blocks,
            f"; capped at {cap}, all max_num_seqs at max_model_len x2"
            if cap < pool.num_blocks
            else "",
        )
        return min(pool.num_blocks, cap)

    def _measure_gpu_memory(self, max_num_batched_tokens: int) -> GpuMemory:
        """One profiling forward of ``max_num_batched_tokens`` tokens (split over up to
        ``max_num_seqs`` prompts, each with logits, then the sampler's softmax and sort) over a
        temporary KV cache just big enough; its peak, less weights and that cache, is the
        activation memory every later step fits in."""
        dev = self.device
        torch.cuda.synchronize(dev)
        weights = torch.cuda.memory_allocated(dev)
        tokens = max(1, min(max_num_batched_tokens, self.max_num_seqs * self.max_model_len))
        num_seqs = min(self.max_num_seqs, tokens)
        lens = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
        per_seq = [-(-n // self.block_size) for n in lens]
        self.kv_caches = self._allocate_kv(sum(per_seq))  # replaced by the real pool after
        tmp_kv = torch.cuda.memory_allocated(dev) - weights
        torch.cuda.reset_peak_memory_stats(dev)
        items, first = [], 0
        for i, (n, nb) in enumerate(zip(lens, per_seq)):
            items.append(
                BatchItem(f"profile-{i}", [0] * n, 0, list(range(first, first + nb)), True)
            )
            first += nb
        logits = self.execute(items)
        logits.log_softmax(-1).sort(dim=-1, descending=True)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - weights - tmp_kv
        del logits, self.kv_caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        others = self._total_memory - self._free_at_start  # held before we started
        non_torch = max(0, (total - free) - others - torch.cuda.memory_reserved(dev))
        return GpuMemory(total, self._free_at_start, weights, max(peak, 0), non_torch)

    def _decode_graphs(self, capture: bool) -> DecodeGraphs | None:
        """Graphs need the triton backend (its launchers take grids from shapes only)."""
        if not isinstance(self.attention, TritonBackend):
            logger.info("CUDA graphs off: they need the triton attention backend")
            return None
        max_blocks = -(-self.max_model_len // self.block_size)
        graphs = DecodeGraphs(
            self._graph_forward,
            capture_sizes(self.max_num_seqs),
            max_blocks,
            self.device,
            capture=capture,
        )
        t0 = time.perf_counter()
        with torch.inference_mode():
            graphs.capture()
        if capture:
            logger.info(
                "CUDA graphs captured for decode batches %s in %.1f s",
                graphs.sizes,
                time.perf_counter() - t0,
            )
        return graphs

    def _graph_forward(self, g: GraphInputs) -> torch.Tensor:
        """The decode forward over static inputs: no host values, so it can be captured."""
        cos, sin = self.rope.gather(g.positions)
        meta = TritonMetadata(
            slot_mapping=g.slot_mapping,
            block_tables=g.block_tables,
            query_start_loc=g.query_start_loc,
            seq_lens=g.seq_lens,
            max_query_len=1,
            decode_only=True,
            block_size=self.block_size,
            sliding_window=self.model_config.sliding_window,
        )
        out: torch.Tensor = self.model(g.input_ids, cos, sin, meta, self.kv_caches, g.logit_rows)
        return out

    def _measured_strategies(
        self,
        setting: kernels.Setting,
        kern: kernels.Kernels | None,
        fused: kernels.Kernels | None,
        block_size: int,
        max_num_batched_tokens: int = 512,
    ) -> Strategies:
        """Times the GEMM and attention paths on this model's shapes (or takes the cached or
        ITERSERVE_KERNELS-fixed choice), logs it, and returns the strategies that run it."""
        cfg, kinds = self.model_config, DecoderLayer.LINEARS
        weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        # the MLP's act (DecoderLayer.select_strategies): gate_up is timed with it, in its layout
        act = choose_act(fused, cfg.intermediate_size)
        if self.model.layers:  # a layerless model (tests) times its LM head only
            layer0 = self.model.layers[0]
            weights = {
                k: (getattr(layer0, f"{k}_proj"), getattr(layer0, f"{k}_bias")) for k in kinds
            }
            weights["gate_up"] = gate_up_layout(act, *weights["gate_up"])
        weights["lm_head"] = (self.model.lm_head, None)
        prob = autotune.Problem(
            weights=weights,
            dtype=self.dtype,
            max_rows={
                # a step's GEMMs get at most its token budget of rows
                **dict.fromkeys(kinds, max(1, max_num_batched_tokens)),
                "lm_head": autotune.LOGIT_ROWS,
            },
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=block_size,
            max_decodes=autotune.DECODE_BUCKETS[-1],
            max_ctx=self.max_model_len,
            gate_up_act=act,
        )
        builders = autotune.gemm_builders(self.dtype, kern, self._pack_allowed(flags=False))
        cpu = isinstance(self.attention, CpuBackend)
        with torch.inference_mode():
            choice = autotune.choose(prob, builders, kern, cpu, setting)
        for line in choice.log_lines():
            logger.info("kernel choice (%s): %s", choice.source, line)
        self.kernel_choice = choice
        used = {p for paths in choice.gemm.values() for p in paths}
        self.packed_weights = "packed" in used
        self.panel_weights = "panels" in used
        if choice.attn and isinstance(self.attention, CpuBackend):
            assert kern is not None
            self.attention.decodes = autotune.decode_router(kern, choice.attn)
        if choice.prefill == ("torch",) and isinstance(self.attention, CpuBackend):
            self.attention.use_prefill_kernel(False)

        def linear(kind: str, w: torch.Tensor, b: torch.Tensor | None) -> Linear:
            return autotune.route(  # type: ignore[no-any-return]
                choice.gemm[kind], autotune.ROW_BUCKETS, lambda p: builders[p](w, b)
            )

        glu = autotune.epilogue_rule(choice.glu) if choice.glu else None
        return Strategies(attention=self.attention, fused=fused, linear=linear, glu_epilogue=glu)

    def _pack_allowed(self, flags: bool) -> bool:
        """Whether GEMM weights may get a prepacked f32 copy (``PackedLinear``): where the copy
        takes at most half the free memory (``flags``: the fixed rules, which pack every f32
        model and low-precision ones on CPUs that only emulate them).
        ``ITERSERVE_PACK_WEIGHTS=0`` / ``=1`` forces it off / on (measured: only allows it)."""
        env = os.environ.get("ITERSERVE_PACK_WEIGHTS", "auto").strip().lower()
        if env not in ("0", "1", "auto"):
            raise ValueError(f"ITERSERVE_PACK_WEIGHTS must be 0, 1 or auto, got {env!r}")
        if env == "0" or not packing_available():
            return False
        if env == "1" or (flags and self.dtype == torch.float32):
            return True
        if flags and not needs_upcast(self.dtype):
            return False
        return _within_half_free(
            self.model.linear_weight_bytes(),
            "not packing weights: their f32 copy (%d MB) exceeds half the free memory",
        )

    def _pairs12_fit(self, lm_head: bool) -> bool:
        """Whether the layers' 12-bit weight copies (3/4 of their bf16 bytes: 3/8 of their f32
        size), with ``lm_head`` the LM head's too, take at most half the free memory."""
        return _within_half_free(
            self.model.linear_weight_bytes(lm_head) * 3 // 8,
            "no 12-bit copies of the layers' GEMM weights%s: they (%%d MB) would exceed half "
            "the free memory" % (" and the LM head" if lm_head else ""),
        )

    def reset_kv_cache(self) -> None:
        """Zero every slot (after a failed step, whose partial writes must not leak)."""
        for k, v in self.kv_caches:
            k.zero_()
            v.zero_()

    def execute(self, items: Sequence[BatchItem], greedy: bool = False) -> torch.Tensor:
        """Runs one forward over all items; float32 logits [num items with need_logits, vocab],
        in the order those items appear in ``items`` (for each, the logits of its last token).
        ``greedy``: their argmax instead, int64 [num items with need_logits] (the first index
        of the maximum, as the sampler's greedy pick; no item may have ``prompt_targets``):
        where the LM head can, it never stores the logits."""
        if greedy and any(it.prompt_targets for it in items):
            raise ValueError("execute(greedy=True) takes no items with prompt_targets")
        return self._run(items, greedy)[0]

    def execute_with_prompt_logprobs(
        self, items: Sequence[BatchItem]
    ) -> tuple[torch.Tensor, dict[str, list[TokenLogprobs]]]:
        """``execute``, plus the prompt logprobs of the items with ``prompt_targets``: the
        lm_head also runs on those items' prompt rows, in the same forward."""
        return self._run(items, False)

    def _run(
        self, items: Sequence[BatchItem], greedy: bool
    ) -> tuple[torch.Tensor, dict[str, list[TokenLogprobs]]]:
        if not items:
            if greedy:
                return torch.empty(0, dtype=torch.int64, device=self.device), {}
            return torch.empty(0, self.vocab_size, device=self.device), {}
        if self.thread_governor is not None:
            self.thread_governor.tick()
        bs = self.block_size
        # Decode-first row order (see attention.py): one batched call for all single-token items.
        order = [i for i, it in enumerate(items) if len(it.token_ids) == 1]
        num_decodes = len(order)
        order += [i for i, it in enumerate(items) if len(it.token_ids) != 1]
        ids: list[int] = []
        positions: list[int] = []
        step_items: list[StepItem] = []
        last_row = [0] * len(items)
        first_row = [0] * len(items)
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
            if it.prompt_targets is not None and len(it.prompt_targets) > n:
                raise ValueError(
                    f"request {it.request_id}: {len(it.prompt_targets)} prompt targets for "
                    f"{n} tokens"
                )
            first_row[i] = len(ids)
            ids.extend(it.token_ids)
            positions.extend(range(p0, p0 + n))
            last_row[i] = len(ids) - 1
            step_items.append(StepItem(n, p0, it.block_table))
        logit_rows = [last_row[i] for i, it in enumerate(items) if it.need_logits]
        num_sampled = len(logit_rows)
        prompt_items = [(i, it) for i, it in enumerate(items) if it.prompt_targets]
        for i, it in prompt_items:
            assert it.prompt_targets is not None
            logit_rows.extend(range(first_row[i], first_row[i] + len(it.prompt_targets)))

        if (
            self.graphs is not None
            and not prompt_items
            and num_decodes == len(items)
            and self.graphs.can_run(len(items), max(positions) // bs + 1)
        ):
            logits = self._replay_decodes(ids, positions, step_items, logit_rows)
            return (logits.argmax(-1) if greedy else logits), {}
        with torch.inference_mode():
            if self.device.type == "cpu":  # one torch call for the three
                # Every row, in order, needs no rows tensor (the model then gathers nothing): T
                # logit rows from T tokens, at most one per item, is T single-token items.
                every_row = not prompt_items and num_sampled == len(ids)
                T = len(ids)
                flat = torch.tensor(
                    positions + ids + ([] if every_row else logit_rows), dtype=torch.int64
                )
                pos, ids_t = flat[:T], flat[T : 2 * T]
                rows_t: torch.Tensor | None = None if every_row else flat[2 * T :]
            else:  # one pinned copy for the runner's inputs (the backend's metadata is another)
                pos, ids_t, rows_t = to_device_int32([positions, ids, logit_rows], self.device)
            cos, sin = self.rope.gather(pos)
            step = StepMetadata(
                step_items,
                num_decodes,
                bs,
                self.model_config.sliding_window,
                self.dtype,
                self.device,
            )
            logits = self.model(
                ids_t,
                cos,
                sin,
                self.attention.build_metadata(step),  # once per step, shared by all layers
                self.kv_caches,
                rows_t,
                greedy=greedy,
                kern=self.kernels,
            )
            if not prompt_items:
                return logits, {}
            return logits[:num_sampled], _prompt_logprobs(logits[num_sampled:], prompt_items)

    def _replay_decodes(
        self,
        ids: list[int],
        positions: list[int],
        items: Sequence[StepItem],
        logit_rows: list[int],
    ) -> torch.Tensor:
        assert self.graphs is not None
        bs = self.block_size
        tables = [it.block_table[: p // bs + 1] for it, p in zip(items, positions)]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        with torch.inference_mode():
            logits = self.graphs.run(ids, positions, slots, tables)
            if len(logit_rows) == len(ids):
                return logits.clone()  # the graph's buffer is overwritten by the next replay
            rows = torch.tensor(logit_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            return logits.index_select(0, rows)


def _prompt_logprobs(
    logits: torch.Tensor, prompt_items: list[tuple[int, BatchItem]]
) -> dict[str, list[TokenLogprobs]]:
    """Splits the prompt rows' logits ([sum of targets, vocab], in ``prompt_items`` order)
    into each item's (target, logprob, rank (1 = most likely), top-k [(id, logprob)]) per
    target, from the log-softmax of the float32 logits."""
    lps = logits.log_softmax(-1)
    targets = torch.tensor(
        [t for _, it in prompt_items for t in it.prompt_targets or ()], dtype=torch.int64
    ).to(lps.device)
    tlp = lps.gather(1, targets.unsqueeze(1))
    ranks = (lps >= tlp).sum(-1, keepdim=True)  # ties count ahead of it, as in vLLM
    k = max(it.prompt_top_k for _, it in prompt_items)
    top_v, top_i = lps.topk(k, dim=-1) if k else (lps[:, :0], ranks[:, :0])
    # The step's one device-to-host copy: float32 logprobs, ids and ranks (< 2**53) are all
    # exact in float64.
    table = torch.cat([t.double() for t in (tlp, ranks, top_v, top_i)], 1).tolist()
    out: dict[str, list[TokenLogprobs]] = {}
    r = 0
    for _, it in prompt_items:
        targets_i = it.prompt_targets or []
        got: list[TokenLogprobs] = []
        for t, row in zip(targets_i, table[r : r + len(targets_i)]):
            top = [(int(row[2 + k + j]), row[2 + j]) for j in range(it.prompt_top_k)]
            got.append((t, row[0], int(row[1]), top))
        out[it.request_id] = got
        r += len(targets_i)
    return out
