"""Configuration: one frozen dataclass per layer, validated once, and the flat
``EngineArgs`` that the Python API and every CLI (serve, bench, simulate) derive from."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, fields
from typing import Any

POLICIES = ("continuous", "static", "priority")
DTYPES = ("float32", "bfloat16", "float16")

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
            f"kv_cache_memory must be a byte count like '2GiB', '512MiB' or 1073741824, got {value!r}"
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

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 (or None to size from kv_cache_memory), got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "continuous"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}) so any prompt fits one step; raise it or lower max_model_len"
            )


@dataclass
class EngineArgs:
    """Every engine knob in one flat place; ``LLM(**kwargs)`` and the CLIs both use it."""

    model: str = "tiny-random"
    dtype: str = "float32"
    policy: str = "continuous"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: str = "2GiB"
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None
    record_steps: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        parse_size(self.kv_cache_memory)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory=parse_size(self.kv_cache_memory),
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            policy=self.policy,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_model_len=max_model_len,
        )

    # ---- CLI derivation -------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Adds one ``--flag`` per field (``--no-flag`` for booleans that default to True)."""
        defaults = cls()
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = getattr(defaults, f.name)
            if isinstance(default, bool):
                parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
            elif f.name in ("num_kv_blocks", "max_model_len", "num_threads"):
                parser.add_argument(flag, dest=f.name, type=int, default=default)
            elif f.name in ("record_steps",):
                parser.add_argument(flag, dest=f.name, type=str, default=default)
            elif f.name == "policy":
                parser.add_argument(flag, dest=f.name, choices=POLICIES, default=default)
            elif f.name == "dtype":
                parser.add_argument(flag, dest=f.name, choices=DTYPES, default=default)
            else:
                parser.add_argument(flag, dest=f.name, type=type(default), default=default)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
        kwargs = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        kwargs.update(overrides)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)
