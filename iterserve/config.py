"""Configuration: one frozen dataclass per layer, validated once, and the flat
``EngineArgs`` that the Python API and every CLI (serve, generate, bench, simulate) derive
their flags from, through ``add_dataclass_args``."""

from __future__ import annotations

import argparse
import dataclasses
import numbers
import os
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

# Bytes per element of each dtype name; the runner maps the names onto torch dtypes.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPES = tuple(DTYPE_BYTES)
# Attention backends (iterserve/model/attention_backends.py); auto: triton on CUDA, the C++
# kernels on CPU where they build, else the torch reference.
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
# auto: cuda when torch.cuda.is_available(), else cpu (iterserve/model/device.py).
DEVICES = ("auto", "cpu", "cuda")
# kv_cache_memory on CPU when neither it nor num_kv_blocks is given.
DEFAULT_CPU_KV_MEMORY = "2GiB"
# max_num_batched_tokens when none is given (without chunked prefill: max_model_len where more;
# EngineArgs.token_budget).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


def policy_names() -> tuple[str, ...]:
    """The scheduling policies' names, from their one registry (``core.policies``)."""
    from iterserve.core.policies import POLICY_CLASSES  # late: iterserve.core imports us

    return tuple(POLICY_CLASSES)


def _scheduler_choices() -> dict[str, tuple[str, ...]]:
    """The named choices of the scheduler's string knobs, from ``core.policies``."""
    from iterserve.core.policies import RESERVATIONS, VICTIMS  # late: iterserve.core imports us

    return {"preemption_victim": VICTIMS, "admission_reservation": RESERVATIONS}


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; an int passes through."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {value}")
        return value
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(
            "kv_cache_memory must be a byte count like '2GiB', '512MiB' or 1073741824, "
            f"got {value!r}"
        )
    num, unit, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    base = 1024 if binary or unit == "" else 1000
    power = " KMGT".index(unit) if unit else 0
    size = int(num * base**power)
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 2 * 1024**3
    enable_prefix_caching: bool = True
    # Set (on a GPU, with neither num_kv_blocks nor kv_cache_memory given): the runner sizes
    # the pool by profiling, from this fraction of the card (device.kv_pool_from_memory).
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        _check_utilization(self.gpu_memory_utilization)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(
                "num_kv_blocks must be >= 1 (or None to size from kv_cache_memory), "
                f"got {self.num_kv_blocks}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's knobs (docs/SCHEDULING.md says what each buys).

    ``preemption_victim``: None takes the policy's own (``newest``; ``lowest-priority`` for
    ``priority``). ``preemption_protect_steps``: a request resumed after preemption is not
    preempted again for this many steps unless no other running request can be.
    ``preemption_resume_headroom`` (0: off): a preempted request resumes only when the free
    KV blocks cover every running request's and its own prompt plus this many tokens more.
    ``admission_reservation``: KV blocks admission keeps back for running requests' future
    tokens. ``long_prefill_threshold`` (0: off): a prompt with more uncomputed tokens than
    this is long; it is prefilled at most this many tokens a step, and at most
    ``max_long_partial_prefills`` long prompts are part-way through at once (a running one
    holds its place until its uncomputed tokens fall to the threshold), so short prompts pass
    them.
    ``tenant_weights`` ('alice=2,bob=1'; others weigh 1): the ``fair`` policy's shares.
    ``slo_ttft_ms`` / ``slo_tpot_ms``: the ``slo`` policy's TTFT / TPOT targets for
    requests that carry none.
    """

    policy: str = "continuous"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048
    preemption_victim: str | None = None
    preemption_protect_steps: int = 0
    preemption_resume_headroom: int = 32
    admission_reservation: str = "optimistic"
    long_prefill_threshold: int = 0
    max_long_partial_prefills: int = 1
    tenant_weights: str = ""
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        _check_policy(self.policy)
        _check_scheduler_knobs(self)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # vLLM's start-up error: else prompts longer than the budget could never run
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) so any prompt fits one step; raise it, lower "
                "max_model_len, leave it unset (it is then max_model_len) or enable chunked "
                "prefill"
            )


# --help texts of the engine's flags (the policy and generation-config ones are built below)
_ENGINE_HELP = {
    "model": "a built-in name (tiny-random, bench-134m, smollm2-135m), an HF folder, a .gguf "
    "file or a Hub id",
    "dtype": "weights and activations",
    "max_num_seqs": "sequences running at once (the batch's slots)",
    "max_num_batched_tokens": "tokens one step may schedule (prefill chunks and decodes; "
    f"default: {DEFAULT_MAX_NUM_BATCHED_TOKENS}, without chunked prefill max_model_len where "
    "more)",
    "enable_chunked_prefill": "split long prompts over steps within the token budget",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "KV-cache blocks (instead of --kv-cache-memory)",
    "kv_cache_memory": f"KV-cache size, e.g. 2GiB or 512MB (default: {DEFAULT_CPU_KV_MEMORY} on "
    "CPU, --gpu-memory-utilization on CUDA)",
    "enable_prefix_caching": "reuse the KV blocks of shared prompt prefixes",
    "max_model_len": "context length, prompt and output (default: the model's)",
    "seed": "seed of sampling without a request seed",
    "num_threads": "CPU threads for the forward (default: the CPUs this process may run on)",
    "record_steps": "write every step's stats (JSON lines) to this file",
    "preemption_victim": "which running sequence gives its KV blocks up (default: the policy's)",
    "preemption_protect_steps": "steps a sequence resumed after preemption is safe from "
    "preemption again (unless no other can go)",
    "preemption_resume_headroom": "free blocks a preempted sequence waits for before it resumes",
    "admission_reservation": "KV blocks held for a request's output at admission",
    "long_prefill_threshold": "prompts longer than this many tokens are long (0: none)",
    "max_long_partial_prefills": "long prompts part-way through at once",
    "tenant_weights": "fair policy: NAME=WEIGHT,... shares by tenant (the request's user)",
    "slo_ttft_ms": "slo policy: the TTFT target of requests that set none (ms)",
    "slo_tpot_ms": "slo policy: the TPOT target of requests that set none (ms)",
    "attention_backend": "attention implementation (default: $ITERSERVE_ATTENTION_BACKEND, "
    "else auto)",
    "device": "where the model runs",
    "gpu_memory_utilization": "CUDA: fraction of the GPU for weights, activations and the KV "
    "cache, when no KV size is given",
    "enforce_eager": "CUDA: no CUDA graphs",
}


@dataclass
class EngineArgs:
    """Every engine knob in one flat place; ``LLM(**kwargs)`` and the CLIs both use it."""

    model: str = "tiny-random"
    dtype: str = "float32"
    policy: str = "continuous"
    max_num_seqs: int = 64
    # None: DEFAULT_MAX_NUM_BATCHED_TOKENS, raised to max_model_len without chunked prefill
    # (token_budget, vLLM's default); a given one is used as given.
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    # None: DEFAULT_CPU_KV_MEMORY on CPU, gpu_memory_utilization on CUDA.
    kv_cache_memory: str | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None
    record_steps: str | None = None
    preemption_victim: str | None = None
    preemption_protect_steps: int = 0
    preemption_resume_headroom: int = 32
    admission_reservation: str = "optimistic"
    long_prefill_threshold: int = 0
    max_long_partial_prefills: int = 1
    tenant_weights: str = ""
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # None: $ITERSERVE_ATTENTION_BACKEND, else auto.
    attention_backend: str | None = None
    device: str = "auto"
    # Fraction of the GPU for weights, activations and the KV pool (used when neither
    # num_kv_blocks nor kv_cache_memory is given).
    gpu_memory_utilization: float = 0.9
    # No CUDA graphs: every step runs eagerly (CPU steps always do).
    enforce_eager: bool = False
    # Where requests that leave temperature, top_p, top_k, min_p, the penalties or max_tokens
    # unset get them (vLLM's flag): "auto" the model folder's generation_config.json, "vllm"
    # nowhere (the neutral defaults), else a folder holding a generation_config.json.
    generation_config: str = "auto"
    # Sampling defaults that win over the generation config's, e.g. {"temperature": 0.5}.
    override_generation_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        memory: object = self.kv_cache_memory
        if isinstance(memory, numbers.Integral) and not isinstance(memory, bool):
            self.kv_cache_memory = str(int(memory))  # bytes, as parse_size reads an int
        _check_field_types(self)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 (None: all cores), got {self.num_threads}")
        check_block_size(self.block_size)  # here too: the simulator builds no CacheConfig
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError(
                "give num_kv_blocks or kv_cache_memory, not both (num_kv_blocks would win and "
                "kv_cache_memory be ignored)"
            )
        _check_utilization(self.gpu_memory_utilization)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        _check_policy(self.policy)
        _check_scheduler_knobs(self)
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.generation_config:
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a folder with a "
                "generation_config.json, got ''"
            )
        if self.override_generation_config is not None:
            if not isinstance(self.override_generation_config, dict):
                raise ValueError(
                    "override_generation_config must be a JSON object such as "
                    f'{{"temperature": 0.5}}, got {self.override_generation_config!r}'
                )
            from iterserve.sampling_params import sampling_defaults

            sampling_defaults({}, self.override_generation_config, "override_generation_config")

    def unused_knobs(self) -> dict[str, str]:
        """The scheduler knobs set that the chosen policy would not read, each with why:
        ``LLMEngine`` refuses them (one policy: a knob it ignores is a mistake), where a run
        over several policies (``variant_args``) drops them for the policies that ignore them.
        A user policy (module:Class) may read anything: nothing is said of it."""
        from iterserve.core.policies import FairPolicy, SloPolicy, policy_class

        if self.policy not in policy_names():
            return {}
        cls, out = policy_class(self.policy), {}
        if self.tenant_weights and not issubclass(cls, FairPolicy):
            out["tenant_weights"] = "only the fair policy reads it"
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if getattr(self, name) is not None and not issubclass(cls, SloPolicy):
                out[name] = "only the slo policy reads it"
        if self.max_long_partial_prefills != 1 and not self.long_prefill_threshold:
            out["max_long_partial_prefills"] = "only with long_prefill_threshold > 0"
        return out

    def check_knobs_used(self) -> None:
        """Raises the ValueError naming the knobs ``unused_knobs`` finds, if any."""
        unused = self.unused_knobs()
        if unused:
            knobs = "; ".join(f"{name} ({why})" for name, why in unused.items())
            raise ValueError(
                f"policy {self.policy!r} would ignore {knobs}: drop them, or give what each "
                "needs (a policy that reads it, or the setting named)"
            )

    def sampling_defaults(self, model_path: str) -> dict[str, int | float]:
        """The SamplingParams defaults of requests that leave a sampling field unset, for the
        model in ``model_path`` (``generation_config`` and ``override_generation_config``)."""
        from iterserve.model.model_config import read_generation_config
        from iterserve.sampling_params import sampling_defaults

        src = self.generation_config
        if src == "vllm":
            config: dict[str, Any] = {}
        elif src == "auto":
            config = read_generation_config(model_path)
        else:
            config = read_generation_config(src, required=True)
        folder = model_path if src in ("auto", "vllm") else src
        where = os.path.join(folder, "generation_config.json")
        return sampling_defaults(config, self.override_generation_config, where)

    def max_tokens_cap(self, defaults: Mapping[str, int | float]) -> int | None:
        """The server-wide limit on every request's max_tokens, as vLLM's: the max_new_tokens
        of a generation_config FOLDER's file, or of override_generation_config (the model's
        own file's is only a default). ``defaults``: ``sampling_defaults``'s answer."""
        if self.generation_config in ("auto", "vllm"):
            value = (self.override_generation_config or {}).get("max_new_tokens")
        else:
            value = defaults.get("max_tokens")
        return None if value is None else int(value)

    def cache_config(self, device_type: str = "cpu") -> CacheConfig:
        """On ``cuda`` with neither ``num_kv_blocks`` nor ``kv_cache_memory`` the pool is sized
        from ``gpu_memory_utilization`` by the runner."""
        profile = device_type == "cuda" and self.num_kv_blocks is None
        profile = profile and self.kv_cache_memory is None
        return CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory=parse_size(self.kv_cache_memory or DEFAULT_CPU_KV_MEMORY),
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization if profile else None,
        )

    def token_budget(self, max_model_len: int) -> int:
        """The tokens one step may schedule with context ``max_model_len``: the given
        budget, else the default, raised to ``max_model_len`` without chunked prefill so any
        prompt fits one step (vLLM's rule). The one place it is derived: the engine, every
        policy variant and the simulator take it from here (through ``scheduler_config``);
        a given budget below the context without chunked prefill is SchedulerConfig's error,
        as in vLLM."""
        return token_budget(self.max_num_batched_tokens, self.enable_chunked_prefill, max_model_len)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """Every SchedulerConfig field is an EngineArgs field of the same name, except the
        context length, which the loaded model decides, and the token budget, which follows
        from it where none is given."""
        knobs = {f.name: getattr(self, f.name) for f in fields(SchedulerConfig)}
        return SchedulerConfig(
            **{
                **knobs,
                "max_model_len": max_model_len,
                "max_num_batched_tokens": self.token_budget(max_model_len),
            }
        )

    # ---- CLI derivation -------------------------------------------------------------
    @classmethod
    def add_cli_args(
        cls, parser: argparse._ActionsContainer, **options: Any
    ) -> argparse._ActionsContainer:
        """One ``--flag`` per field (see ``add_dataclass_args``, which takes ``options``);
        ``--dtype`` and the scheduler's knobs offer their registries' names, ``--policy`` a
        registered name or a user policy ``module:Class`` (unless ``choices`` overrides it,
        as the simulator's comma-separated list does)."""
        overrides = options.pop("choices", {})
        arg_types: dict[str, Callable[[str], object]] = {"override_generation_config": _json_object}
        if "policy" not in overrides:
            arg_types["policy"] = _policy_arg
        choices = {
            "dtype": DTYPES,
            "attention_backend": ATTENTION_BACKENDS,
            "device": DEVICES,
            **_scheduler_choices(),
            **overrides,
        }
        helps = {
            **_ENGINE_HELP,
            "policy": f"one of {', '.join(policy_names())}, or module:Class (a Policy subclass)",
            "generation_config": "where requests that leave temperature, top_p, top_k, min_p, "
            "the penalties or max_tokens unset get them: auto (the model's "
            "generation_config.json), vllm (nowhere: neutral defaults) or a folder",
            "override_generation_config": "a JSON object of sampling defaults that win, e.g. "
            "'{\"temperature\": 0.5}'",
            **options.pop("helps", {}),
        }
        add_dataclass_args(parser, cls, choices=choices, helps=helps, types=arg_types, **options)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
        return cls(**cli_kwargs(cls, ns, **overrides))

    def replace(self, **changes: Any) -> EngineArgs:
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:  # a vLLM script's knobs (trust_remote_code, swap_space, ...) among them
            raise ValueError(
                f"unknown engine argument(s) {', '.join(unknown)}: iterserve's are the "
                "EngineArgs fields (iterserve/config.py; `iterserve serve --help` lists them)"
            )
        return dataclasses.replace(self, **changes)


def _json_object(text: str) -> dict[str, Any]:
    """argparse type of a JSON-object flag."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"temperature\": 0.5}}', got {text!r}"
        )
    return value


def _plain(kind: str, value: object) -> object:
    """``value`` as the plain ``kind`` (bool, int, float, str) it stands for, or a
    ValueError-raising sentinel (None) where it stands for none: numpy numbers and paths
    pass, a string for a number or a bool does not ("false" would read as true)."""
    if isinstance(value, str | bytes):
        return value if kind == "str" and isinstance(value, str) else None
    if kind == "str":
        return os.fspath(value) if isinstance(value, os.PathLike) else None
    if kind == "bool":
        item = value.item() if hasattr(value, "item") else value  # numpy's bool_ is no Integral
        return bool(item) if isinstance(item, numbers.Integral) and item in (0, 1) else None
    if isinstance(value, bool):  # a bool is an Integral, but not a count
        return None
    if kind == "int":
        if isinstance(value, numbers.Integral):
            return int(value)  # numpy ints too
        if isinstance(value, numbers.Real) and float(value).is_integer():
            return int(float(value))  # 8.0
        return None
    return float(value) if isinstance(value, numbers.Real) else None


def _check_field_types(obj: object) -> None:
    """Each field of a plain type holds that type, made plain (numpy numbers, paths):
    Python callers' values are not parsed as the CLI's are."""
    for f in fields(obj):  # type: ignore[arg-type]
        parts = [p.strip() for p in str(f.type).split("|")]
        kinds = [p for p in parts if p != "None"]
        if len(kinds) != 1 or kinds[0] not in ("bool", "int", "float", "str"):
            continue
        value = getattr(obj, f.name)
        if value is None and "None" in parts:
            continue
        plain = _plain(kinds[0], value)
        if plain is None:
            raise ValueError(f"{f.name} must be {' | '.join(parts)}, got {value!r}")
        setattr(obj, f.name, plain)


def token_budget(given: int | None, enable_chunked_prefill: bool, max_model_len: int) -> int:
    """``EngineArgs.token_budget``'s rule, for callers without EngineArgs (the simulator's
    deployment sizes its activation memory by it)."""
    if given is not None:
        return given
    if enable_chunked_prefill:
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)


def kv_block_cap(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most blocks worth tracking: every sequence at full length at once, x2 to leave
    room for cached prefixes (a memory budget for a tiny model would otherwise mean millions
    of blocks for the KV manager to track, never used). The engine's rule and the CPU
    simulator's."""
    return 2 * max_num_seqs * -(-max_model_len // block_size)


def check_block_size(value: int) -> None:
    if not 1 <= value <= 1024:
        raise ValueError(f"block_size must be in [1, 1024], got {value}")


def _check_utilization(value: float | None) -> None:
    if value is not None and not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value}")


def _check_policy(name: str) -> None:
    from iterserve.core.policies import policy_class  # late: iterserve.core imports us

    policy_class(name)


def _policy_arg(text: str) -> str:
    """argparse type of ``--policy``: the registry's error as the usage error."""
    try:
        _check_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _check_scheduler_knobs(c: SchedulerConfig | EngineArgs) -> None:
    # late: iterserve.core imports us
    from iterserve.core.policies import FairPolicy, parse_tenant_weights, policy_class

    for name, allowed in _scheduler_choices().items():
        value = getattr(c, name)
        if value is not None and value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if c.preemption_protect_steps < 0:
        raise ValueError(f"preemption_protect_steps must be >= 0, got {c.preemption_protect_steps}")
    if c.preemption_resume_headroom < 0:
        raise ValueError(
            f"preemption_resume_headroom must be >= 0 (0: off), got {c.preemption_resume_headroom}"
        )
    if c.preemption_resume_headroom == 0 and issubclass(policy_class(c.policy), FairPolicy):
        # fair ranks a tenant with nothing running first, so it readmits a preempted request
        # ahead of the running one that preempted it; without the resume check two requests
        # the pool cannot hold together could take turns preempting each other for ever.
        raise ValueError(
            "the fair policy needs preemption_resume_headroom >= 1 (default 32): without the "
            "resume check two requests the KV pool cannot hold together can preempt each "
            "other for ever under fair's ranking"
        )
    if c.preemption_resume_headroom == 0 and c.long_prefill_threshold > 0:
        # Long prompts then run a threshold a step side by side: two the pool cannot hold
        # together took turns preempting each other for ever (random scheduler runs).
        raise ValueError(
            "long-prompt mode (long_prefill_threshold > 0) needs preemption_resume_headroom "
            ">= 1 (default 32): without the resume check two long prompts the KV pool cannot "
            "hold together can preempt each other for ever"
        )
    if c.long_prefill_threshold < 0:
        raise ValueError(
            f"long_prefill_threshold must be >= 0 (0: off), got {c.long_prefill_threshold}"
        )
    if c.max_long_partial_prefills < 1:
        raise ValueError(
            f"max_long_partial_prefills must be >= 1, got {c.max_long_partial_prefills}"
        )
    parse_tenant_weights(c.tenant_weights)
    if c.slo_ttft_ms is not None and not c.slo_ttft_ms > 0:
        raise ValueError(f"slo_ttft_ms must be > 0 (or None: no default), got {c.slo_ttft_ms}")
    if c.slo_tpot_ms is not None and not c.slo_tpot_ms > 0:
        raise ValueError(f"slo_tpot_ms must be > 0 (or None: no default), got {c.slo_tpot_ms}")
    if c.long_prefill_threshold and not c.enable_chunked_prefill:
        raise ValueError(
            "long_prefill_threshold needs chunked prefill (long prompts run in chunks); "
            "enable chunked prefill or set long_prefill_threshold to 0"
        )


def _variant_drops(variant: str, base: EngineArgs, max_model_len: int) -> dict[str, str]:
    """The knobs set in ``base`` that ``variant`` runs without, each with why: those its
    policy does not read (``EngineArgs.unused_knobs``) and, without chunked prefill, those
    only chunked prefill can use (a budget below the context, the long-prompt knobs)."""
    from iterserve.core.policies import policy_variant  # late: iterserve.core imports us

    v = policy_variant(variant)
    drops: dict[str, str] = {}
    if not (v.chunked_prefill and base.enable_chunked_prefill):
        budget = base.max_num_batched_tokens
        if budget is not None and budget < max_model_len:
            drops["max_num_batched_tokens"] = (
                f"{budget} is below max_model_len {max_model_len}: without chunked prefill one "
                f"step must hold a whole prompt, so raise it to >= {max_model_len} or lower "
                f"max_model_len to <= {budget}; unset, it is "
                f"{token_budget(None, False, max_model_len)}"
            )
        if base.long_prefill_threshold:
            drops["long_prefill_threshold"] = "long prompts need chunked prefill"
    defaults = EngineArgs.__dataclass_fields__
    args = base.replace(policy=v.policy, **{n: defaults[n].default for n in drops})
    return drops | args.unused_knobs()


def variant_args(variant: str, base: EngineArgs, max_model_len: int) -> EngineArgs:
    """``base`` set up as policy variant ``variant`` (``core.policies.POLICY_VARIANTS``) for
    a run with context ``max_model_len``. A knob meant for other variants of the run
    (``check_variants`` names them) is dropped: tenant weights for all but fair, a budget
    below the context or a long-prompt threshold for a variant without chunked prefill. The
    budget itself is left to ``EngineArgs.token_budget``."""
    from iterserve.core.policies import policy_variant  # late: iterserve.core imports us

    defaults = EngineArgs.__dataclass_fields__
    changes = {n: defaults[n].default for n in _variant_drops(variant, base, max_model_len)}
    changes |= {"policy": policy_variant(variant).policy, "record_steps": None}
    if not policy_variant(variant).chunked_prefill:
        changes["enable_chunked_prefill"] = False
    return base.replace(**changes)


def check_variants(
    policies: list[str], base: EngineArgs, max_model_len: int
) -> dict[str, dict[str, str]]:
    """Raises the ValueError ``base`` would raise under any of ``policies`` with context
    ``max_model_len`` (e.g. fair with no resume headroom, a budget too small for a variant
    without chunked prefill), or for a knob no policy of the run can use, before a run
    starts, not when that policy's turn comes. Returns, for each variant that runs without
    some knob of ``base`` (``variant_args`` drops them), those knobs with why, for the
    caller to say."""
    drops = {p: _variant_drops(p, base, max_model_len) for p in policies}  # validates
    unread = set.intersection(*(set(d) for d in drops.values())) if drops else set()
    if unread:  # set for the run, used by none of its policies: a mistake, not a variant's
        why = {k: w for d in drops.values() for k, w in d.items()}
        knobs = "; ".join(f"{name} ({why[name]})" for name in sorted(unread))
        raise ValueError(
            f"no policy of {', '.join(policies)} can use {knobs}: drop it, or give what it "
            "needs (a policy that reads it, or the setting named)"
        )
    for p in policies:  # SchedulerConfig's checks of the budget against the context
        variant_args(p, base, max_model_len).scheduler_config(max_model_len)
    return {p: d for p, d in drops.items() if d}


def variant_notes(policies: list[str], base: EngineArgs, max_model_len: int) -> list[str]:
    """``check_variants``, with each knob a variant runs without as a note for the user, so
    none is ignored unsaid."""
    return [
        f"note: {variant} runs without {name} ({why})"
        for variant, drops in check_variants(policies, base, max_model_len).items()
        for name, why in drops.items()
    ]


def parse_policies(text: str, flag: str = "--policies") -> list[str]:
    """A comma-separated list of policy variants (or user policies ``module:Class``);
    ``flag`` names the option in errors."""
    from iterserve.core.policies import POLICY_VARIANTS, policy_variant  # late: see above

    names = [p.strip() for p in text.split(",") if p.strip()]
    problem = "" if names else "no policy"
    for p in names:
        try:
            policy_variant(p)
        except ValueError as e:
            problem = str(e)
            break
    if problem:
        raise ValueError(
            f"{flag} takes a comma-separated list of {tuple(POLICY_VARIANTS)} or "
            f"module:Class, got {text!r} ({problem})"
        )
    return names


# ---- flags from dataclass fields ------------------------------------------------------------


def _flag_type(annotation: Any) -> Any:
    """``int | None`` -> int; a plain type as is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (inner,) = (a for a in typing.get_args(annotation) if a is not type(None))
        return inner
    return annotation


def add_dataclass_args(
    parser: argparse._ActionsContainer,
    cls: type,
    *,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
    choices: Mapping[str, Sequence[str] | None] | None = None,
    metavars: Mapping[str, str] | None = None,
    types: Mapping[str, Callable[[str], Any]] | None = None,
) -> None:
    """One ``--flag-name`` per field of dataclass ``cls`` (``--no-flag`` too for booleans),
    typed from the field's annotation, in field order. ``only`` / ``skip`` pick fields;
    ``defaults``, ``helps``, ``choices`` (None: free text), ``metavars`` and ``types`` (a
    parser of the text) override, per field name, the field default and argparse's own."""
    hints = typing.get_type_hints(cls)
    base = cls()
    for f in fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": getattr(base, f.name)}
        if defaults and f.name in defaults:
            kw["default"] = defaults[f.name]
        if helps and f.name in helps:
            kw["help"] = helps[f.name]
        if metavars and f.name in metavars:
            kw["metavar"] = metavars[f.name]
        if choices and choices.get(f.name) is not None:
            kw["choices"] = choices[f.name]
        flag_type = _flag_type(hints[f.name])
        if types and f.name in types:
            kw["type"] = types[f.name]
        elif flag_type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = flag_type
        if kw["default"] is not None and "default" not in kw.get("help", ""):
            kw["help"] = f"{kw.get('help', '')} (default: %(default)s)".lstrip()
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)


def cli_kwargs(cls: type, ns: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    """The fields of dataclass ``cls`` that ``ns`` holds, then ``overrides``."""
    kwargs = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
    kwargs.update(overrides)
    return kwargs
