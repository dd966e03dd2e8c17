"""The GPU path's logic, on CPU: device selection and its errors, the KV memory budget (fake
memory numbers), the flags, and the CUDA-graph runner's padding / buckets / static buffers
(driven with an eager stand-in for capture and replay, over the triton backend under
TRITON_INTERPRET=1). What only a GPU can check is in benchmarks/gpu_check.sh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from iterserve import LLM  # noqa: E402
from iterserve.config import (  # noqa: E402
    CacheConfig,
    EngineArgs,
    kv_block_cap,  # noqa: E402
)
from iterserve.model import device as dv  # noqa: E402
from iterserve.model.cuda_graphs import DecodeGraphs, capture_sizes, padded_size  # noqa: E402
from iterserve.model.runner import BatchItem, ModelRunner  # noqa: E402
from tests.test_backends import needs_triton  # noqa: E402
from tests.test_cli_flags import serve_parser  # noqa: E402

GiB = dv.GiB


# ---- device selection ------------------------------------------------------------------------


def test_auto_picks_cuda_only_when_torch_sees_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dv.resolve_device("auto").type == "cpu"
    assert dv.resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="device='cuda' but torch sees no CUDA GPU.*device='cpu'"):
        dv.resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        dv.resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert dv.resolve_device("auto") == torch.device("cuda", 0)  # with its index


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_engine_on_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no CUDA GPU"):
        LLM(device="cuda")


def test_bf16_on_a_card_without_it_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's is_bf16_supported() counts emulation (True on a T4 since torch 2.3): the check
    # goes by the capability alone (it never fired)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla T4")
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="bfloat16 needs .* 8.0.*Tesla T4 is 7.5.*float16"):
        dv.check_dtype(cuda, torch.bfloat16)
    dv.check_dtype(cuda, torch.float16)
    dv.check_dtype(torch.device("cpu"), torch.bfloat16)


# ---- the memory budget -----------------------------------------------------------------------


def _mem(**kw: int) -> dv.GpuMemory:
    base = dict(
        total=100 * GiB, free_at_start=99 * GiB, weights=16 * GiB, peak_activation=2 * GiB,
        non_torch=1 * GiB,
    )  # fmt: skip
    base.update(kw)
    return dv.GpuMemory(**base)


def test_kv_pool_gets_what_is_left_of_the_fraction() -> None:
    per_block = 2 * 1024**2  # 2 MiB
    pool = dv.kv_pool_from_memory(_mem(), 0.9, per_block, 16)
    # 0.9 x 100 GiB = 90 GiB, minus 16 + 2 + 1 GiB = 71 GiB = 36352 blocks of 2 MiB.
    assert pool.budget == int(0.9 * 100 * GiB)
    assert pool.available == pool.budget - 19 * GiB
    assert pool.num_blocks == pool.available // per_block == 36352
    assert pool.kv_bytes == pool.num_blocks * per_block
    assert dv.kv_pool_from_memory(_mem(), 0.5, per_block, 16).num_blocks == 31 * 512


def test_kv_pool_errors_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="only 40.00 GiB were free.*at most 0.40"):
        dv.kv_pool_from_memory(_mem(free_at_start=40 * GiB), 0.9, 1 << 20, 16)
    # the suggestion is rounded down, so that it fits (0.796 was offered as 0.80, which failed)
    with pytest.raises(ValueError, match=r"at most 0\.79$"):
        dv.kv_pool_from_memory(_mem(free_at_start=int(79.6 * GiB)), 0.9, 1 << 20, 16)
    dv.kv_pool_from_memory(_mem(free_at_start=int(79.6 * GiB)), 0.79, 1 << 20, 16)
    with pytest.raises(ValueError, match="no memory left for the KV cache.*Raise --gpu-memory"):
        dv.kv_pool_from_memory(_mem(weights=88 * GiB), 0.9, 1 << 20, 16)


def test_runner_sizes_the_pool_from_measured_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's GPU sizing path on CPU: the measurement is faked, the arithmetic and the
    cap are the runner's own; the engine's max_model_len check then sees that pool."""
    runner = ModelRunner("tiny-random", cache_config=CacheConfig(num_kv_blocks=4))
    per_block = runner.kv_bytes_per_block
    fake = _mem(total=10 * per_block, free_at_start=10 * per_block, weights=per_block,
                peak_activation=per_block, non_torch=0)  # fmt: skip
    monkeypatch.setattr(runner, "_measure_gpu_memory", lambda tokens: fake)
    # 0.9 x 10 blocks of memory = 9, minus weights and activations: 7 blocks.
    assert runner._blocks_from_gpu_memory(0.9, 512) == 7
    runner.max_num_seqs = 1  # cap: 2 x 1 sequence x max_model_len
    cap = kv_block_cap(1, runner.max_model_len, runner.block_size)
    big = _mem(total=10**6 * per_block, free_at_start=10**6 * per_block, weights=0,
               peak_activation=0, non_torch=0)  # fmt: skip
    monkeypatch.setattr(runner, "_measure_gpu_memory", lambda tokens: big)
    assert runner._blocks_from_gpu_memory(0.9, 512) == cap


def test_engine_args_route_the_budget() -> None:
    assert EngineArgs().cache_config("cpu").kv_cache_memory == 2 * GiB
    assert EngineArgs().cache_config("cpu").gpu_memory_utilization is None
    assert EngineArgs().cache_config("cuda").gpu_memory_utilization == 0.9
    for override in ({"num_kv_blocks": 10}, {"kv_cache_memory": "1GiB"}):
        assert EngineArgs(**override).cache_config("cuda").gpu_memory_utilization is None
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineArgs(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="device must be one of"):
        EngineArgs(device="gpu")


def test_gpu_flags_on_every_engine_command() -> None:
    ns = serve_parser().parse_args(
        ["--device", "cuda", "--gpu-memory-utilization", "0.8", "--enforce-eager"]
    )
    args = EngineArgs.from_cli_args(ns)
    assert (args.device, args.gpu_memory_utilization, args.enforce_eager) == ("cuda", 0.8, True)
    defaults = EngineArgs.from_cli_args(serve_parser().parse_args([]))
    assert (defaults.device, defaults.enforce_eager) == ("auto", False)
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--device", "tpu"])


# ---- CUDA graphs: buckets, padding, static buffers --------------------------------------------


def test_capture_sizes_and_padding() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(33) == [1, 2, 4, 8, 16, 24, 32, 33]
    assert capture_sizes(256)[-3:] == [240, 248, 256]
    sizes = capture_sizes(32)
    assert [padded_size(sizes, n) for n in (1, 3, 5, 9, 17, 25, 32)] == [1, 4, 8, 16, 24, 32, 32]
    assert padded_size(sizes, 33) is None


def test_static_buffers_hold_padding() -> None:
    seen: list[dict[str, list[int]]] = []

    def forward(g):  # type: ignore[no-untyped-def]
        seen.append({k: getattr(g, k).tolist() for k in ("input_ids", "positions",
                     "slot_mapping", "seq_lens", "query_start_loc")})  # fmt: skip
        seen[-1]["tables"] = g.block_tables[:, :2].tolist()
        return torch.arange(g.input_ids.shape[0], dtype=torch.float32)[:, None].repeat(1, 5)

    graphs = DecodeGraphs(forward, [1, 2, 4], 3, torch.device("cpu"), capture=False)
    out = graphs.run([7, 8, 9], [5, 0, 17], [21, 32, 77], [[1, 2], [8], [3, 4]])
    assert out.shape == (3, 5)  # padded to 4, sliced back to 3
    s = seen[-1]
    assert s["input_ids"] == [7, 8, 9, 0] and s["positions"] == [5, 0, 17, 0]
    assert s["slot_mapping"] == [21, 32, 77, -1]  # -1: the KV write skips the padding row
    assert s["seq_lens"] == [6, 1, 18, 1] and s["query_start_loc"] == [0, 1, 2, 3, 4]
    assert s["tables"][:3] == [[1, 2], [8, 0], [3, 4]]
    graphs.run([5], [2], [10], [[6]])  # a smaller batch: size 1, no padding
    # Entries past a row's blocks keep older ids: the kernels read blocks < seq_len only.
    assert seen[-1]["slot_mapping"] == [10] and seen[-1]["tables"][0][0] == 6
    with pytest.raises(ValueError, match="no captured size for 5 decodes"):
        graphs.run([1] * 5, [0] * 5, [0] * 5, [[0]] * 5)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(forward, [1], 1, torch.device("cpu"))


CUDA = torch.cuda.is_available()


@needs_triton
@pytest.mark.parametrize("capture", [False, True] if CUDA else [False])
def test_padded_graph_decodes_equal_eager_ones(capture: bool) -> None:
    """The runner's captured decode forward (static buffers, padded to a captured size), run
    eagerly (CPU) or captured and replayed (CUDA), gives the eager step's logits and KV writes
    for the real rows, and writes nothing for the padding rows."""
    bs = 4
    runner = ModelRunner(
        "tiny-random",
        cache_config=CacheConfig(block_size=bs, num_kv_blocks=32),
        attention_backend="triton",
        max_num_seqs=8,
        device="cuda" if CUDA else "cpu",
        enforce_eager=True,
    )
    prompts = [[5, 6, 7, 8, 9], [11, 12], [3, 1, 4, 1, 5, 9, 2]]
    tables = [[0, 1, 2], [3, 4], [5, 6, 7]]
    prefill = [BatchItem(f"r{i}", p, 0, t, True) for i, (p, t) in enumerate(zip(prompts, tables))]
    runner.execute(prefill)
    snapshot = [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    def decodes(last: bool = True) -> list[BatchItem]:
        return [
            BatchItem(f"r{i}", [20 + i], len(p), t, last or i != 1)
            for i, (p, t) in enumerate(zip(prompts, tables))
        ]

    eager = runner.execute(decodes())
    eager_kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, snapshot):
        k.copy_(k0)
        v.copy_(v0)
    runner.graphs = runner._decode_graphs(capture=capture)
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8]
    graphed = runner.execute(decodes())  # 3 rows padded to 4
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(graphed.argmax(-1), eager.argmax(-1))
    for (k, v), (ke, ve) in zip(runner.kv_caches, eager_kv):
        torch.testing.assert_close(k, ke, rtol=1e-6, atol=1e-6)  # padding wrote nothing
        torch.testing.assert_close(v, ve, rtol=1e-6, atol=1e-6)
    # A step where one row needs no logits: the graph's rows are selected after the replay.
    for (k, v), (k0, v0) in zip(runner.kv_caches, snapshot):
        k.copy_(k0)
        v.copy_(v0)
    some = runner.execute(decodes(last=False))
    torch.testing.assert_close(some, eager[[0, 2]], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_engine_on_cuda_sizes_its_pool_and_captures_graphs() -> None:
    llm = LLM("tiny-random", device="cuda", max_num_seqs=8, gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    assert runner.device.type == "cuda" and runner.graphs is not None
    assert runner.num_kv_blocks == kv_block_cap(8, runner.max_model_len, runner.block_size)
    assert llm.engine.runner.kv_caches[0][0].is_cuda


# ---- the GPU check's scripts, dry run ---------------------------------------------------------


@pytest.mark.slow
def test_gpu_check_decode_part_dry_runs_on_cpu(tmp_path: Path) -> None:
    """One part of benchmarks/gpu_check.sh end to end on CPU (--tiny): it writes its report
    section and its numbers (the whole dry run takes minutes: docs/GPU.md has the command)."""
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    argv = [sys.executable, str(root / "benchmarks/gpu/decode_roofline.py"), "--device", "cpu",
            "--tiny", "--out", str(tmp_path)]  # fmt: skip
    subprocess.run(argv, check=True, env=env, cwd=root, timeout=300, capture_output=True)
    report = (tmp_path / "report.md").read_text()
    assert "## 2. Decode step time against the HBM roofline" in report
    assert "--tiny dry run: not a GPU figure" in report
    data = json.loads((tmp_path / "decode_roofline.json").read_text())
    assert [s["batch"] for s in data["steps"]] == [1, 4]
    assert all(s["eager"] > 0 and "graphs" not in s for s in data["steps"])  # no graphs on CPU
