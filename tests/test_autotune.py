"""Kernel choice by measurement (iterserve/model/autotune.py): the pure choice from fake
timings, routing by row count, the cache round trip, ITERSERVE_KERNELS parsing, and a runner
that measures (tiny shapes, milliseconds) then reuses its cached choice."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from iterserve.model import autotune, kernels
from iterserve.model.autotune import DECODE_BUCKETS, KINDS, ROW_BUCKETS, Choice, pick
from iterserve.model.kernels import Setting, parse_setting
from iterserve.model.layers import (
    EPILOGUE_MIN_ROWS,
    GLU_BLOCK,
    FusedSiluMul,
    GateUpAct,
    epilogue_min_rows,
)


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measurements here see no other process (whatever else the machine runs), so the caching
    they test does not depend on it; test_busy_measurement_is_not_cached sets the load."""
    monkeypatch.setattr(autotune.OtherLoad, "cores", lambda self, reset=False: 0.0)


def test_pick_from_fake_timings() -> None:
    # The baseline (first) stays unless another beats it by the margin; None is not timed.
    t = {
        "torch": [1.0, 1.0, 1.0, 1.0],
        "panels": [0.5, 0.97, None, 2.0],
        "packed": [0.6, 2, 3, 0.1],
    }
    assert pick(t, margin=0.05) == ("panels", "torch", "torch", "packed")
    assert pick(t, margin=0.0) == ("panels", "panels", "torch", "packed")
    # Nothing timed in a bucket: the previous bucket's choice (the baseline at the first).
    assert pick({"torch": [None, 2.0, None], "packed": [None, 1.0, None]}) == (
        "torch",
        "packed",
        "packed",
    )
    # The baseline not timed (e.g. upcast below its minimum rows is the torch path): the fastest.
    assert pick({"torch": [None, 1.0], "upcast": [0.5, None]}) == ("upcast", "torch")
    # A near tie at one bucket goes to the path chosen at most buckets (one weight layout, and
    # the one-call-per-layer decode path kept); a clear win keeps its own path.
    near = {
        "torch": [9.0] * 5,
        "pairs": [1.0, 1.02, 3.0, 4.0, 5.0],
        "panels": [2.0, 1.0, 3.5, 9, 9],
    }
    assert pick(near) == ("pairs",) * 5
    clear = {
        "torch": [9.0] * 5,
        "pairs": [1.0, 1.2, 3.0, 4.0, 5.0],
        "panels": [2.0, 1.0, 3.5, 9, 9],
    }
    assert pick(clear) == ("pairs", "panels", "pairs", "pairs", "pairs")  # 1.0 beats 1.2 by 17%
    assert pick(clear, keep=0.25) == ("pairs",) * 5  # but not by 25%
    # 1.10 against 1.0: within the 15% kept by default, beyond the baseline's 5% margin.
    assert (
        pick({"torch": [2.0] * 3, "pairs": [1.1, 1.0, 1.0], "panels": [1.0, 2, 2]})
        == ("pairs",) * 3
    )
    # The baseline kept by the margin at one bucket also yields to the majority's near tie.
    assert pick({"torch": [1.0, 5.0, 5.0], "pairs": [1.02, 1.0, 1.0]}) == ("pairs",) * 3
    # Untimed majority at a bucket: that bucket's own choice stays.
    assert pick(
        {"torch": [1.0, 1.0, 1.0], "pairs": [0.5, None, 0.5], "panels": [0.9, 0.1, 0.9]}
    ) == (
        "pairs",
        "panels",
        "pairs",
    )
    with pytest.raises(ValueError, match="one timing per bucket"):
        pick({"torch": [1.0], "packed": [1.0, 2.0]})
    with pytest.raises(ValueError, match="at least one path"):
        pick({})


def test_pick_untimed_bucket_takes_final_neighbour() -> None:
    """A bucket nobody timed (the budget ran out) takes the previous bucket's choice after the
    near-tie rule: upcast, 10% faster than the panels at 512 rows, lost there to the panels'
    majority, and must not serve the untimed rows above."""
    t = {
        "torch": [9.0, 9.0, 9.0, 9.0, None],
        "panels": [1.0, 1.0, 1.0, 1.0, None],
        "upcast": [None, None, None, 0.9, None],
    }
    assert pick(t) == ("panels",) * 5
    assert pick({"torch": [None, 1.0], "packed": [None, 0.5]}) == ("torch", "packed")  # baseline
    assert pick({"torch": [None, None]}) == ("torch", "torch")


def test_prefer_fused_moves_a_layer_onto_one_family_within_the_margin() -> None:
    """At decode row counts (<= 128 here) the four layer GEMMs take one fused family (pairs and
    amx mixed per GEMM, or panels) where each is within the margin of its chosen path; never
    when one GEMM would lose more, never above the decode rows, never the LM head."""
    from iterserve.model.autotune import prefer_fused

    buckets = (1, 8, 32, 128, 512)
    flat = {"onednn": [1.0] * 5, "amx": [1.2] * 5, "pairs": [1.1, 1.3, 2.0, 3.0, 9.0]}
    timings = {k: dict(flat) for k in KINDS}
    chosen = {k: ("onednn",) * 5 for k in KINDS}
    got = prefer_fused(chosen, timings, buckets, max_rows=128, margin=0.25)
    for k in KINDS[:4]:  # pairs is the family's best at 1 row, amx above; 512 rows stay
        assert got[k] == ("pairs", "amx", "amx", "amx", "onednn"), k
    assert got["lm_head"] == ("onednn",) * 5
    # gate_up's amx 40% slower at 32 rows: that bucket keeps every GEMM where it was
    timings["gate_up"] = {**flat, "amx": [1.2, 1.2, 1.4, 1.2, 1.2], "pairs": [1.1, 9, 9, 9, 9]}
    got = prefer_fused(chosen, timings, buckets, max_rows=128, margin=0.25)
    assert [got[k][2] for k in KINDS[:4]] == ["onednn"] * 4
    assert [got[k][1] for k in KINDS[:4]] == ["amx"] * 4
    # a bucket fused already stays; panels qualify as a family of their own
    panels = {k: {"torch": [1.0] * 5, "panels": [1.1] * 5} for k in KINDS}
    mixed = {k: ("torch", "panels", "torch", "torch", "torch") for k in KINDS}
    got = prefer_fused(mixed, panels, buckets, max_rows=128, margin=0.25)
    assert got["qkv"] == ("panels",) * 4 + ("torch",)
    # no layer GEMMs timed (a model without layers): as chosen
    assert prefer_fused({"lm_head": ("torch",) * 5}, {"lm_head": panels["lm_head"]}) == {
        "lm_head": ("torch",) * 5
    }


def test_time_paths_times_a_long_call_twice() -> None:
    """Best of 3 after a warm-up call, the paths interleaved; a path whose timed calls take
    LONG_CALL_S or more is timed LONG_CALL_REPS times (one timing alone can be an outlier);
    past the deadline nothing more is timed."""
    import time as _time

    n = {"fast": 0, "slow": 0}

    def fast() -> None:
        n["fast"] += 1

    def slow() -> None:
        n["slow"] += 1
        _time.sleep(autotune.LONG_CALL_S + 0.01)

    got = autotune.time_paths({"fast": fast, "slow": slow}, _time.perf_counter() + 60)
    assert autotune.LONG_CALL_REPS == 2 and n == {"fast": 4, "slow": 3}
    assert got["fast"] is not None and got["slow"] is not None
    assert got["slow"] >= autotune.LONG_CALL_S > got["fast"]
    none = autotune.time_paths({"fast": fast}, _time.perf_counter() - 1)
    assert none == {"fast": None} and n["fast"] == 4
    # One call slow: the warm-up (one-time setup, as oneDNN's for a new row count), or the first
    # timed call (an outlier). Either way the path is timed three times, best of 3.
    for slow_call in (1, 2):
        calls: list[int] = []

        def slow_once(calls: list[int] = calls, slow_call: int = slow_call) -> None:
            calls.append(1)
            if len(calls) == slow_call:
                _time.sleep(autotune.LONG_CALL_S + 0.01)

        got = autotune.time_paths({"p": slow_once}, _time.perf_counter() + 60)
        assert len(calls) == 4 and got["p"] is not None and got["p"] < autotune.LONG_CALL_S


def test_measure_gemms_prunes_and_spares_the_last_bucket() -> None:
    """A path PRUNE times slower than the best is skipped at the next bucket and timed again
    at the one after; the first bucket past the decode buckets (512 rows) times every path,
    and the last (2,048-row) bucket takes only paths timed at the bucket before it, pruned by
    that one; upcast is not timed below UPCAST_MIN_ROWS."""
    import time as _time

    rows_seen: list[int] = []

    def fast(w: Any, b: Any) -> Any:
        return lambda x: x

    def slow(w: Any, b: Any) -> Any:
        def run(x: torch.Tensor) -> torch.Tensor:
            rows_seen.append(x.shape[0])
            _time.sleep(0.002)
            return x

        return run

    w = torch.zeros(4, 4)
    out = autotune.measure_gemms(
        {"qkv": (w, None)},
        {"torch": fast, "upcast": slow},
        {"qkv": 4096},
        _time.perf_counter() + 60,
    )
    timed = [t is not None for t in out["qkv"]["upcast"]]
    assert timed == [False, True, False, True, True, False]
    assert all(t is not None for t in out["qkv"]["torch"])
    assert 2048 not in rows_seen and 512 in rows_seen


def test_prefer_in_sequence_moves_prefill_buckets_on_the_layers_time() -> None:
    """Past the decode buckets a layer's four GEMMs move to the per-bucket fastest paths where
    the layer's sequence on them beats the chosen paths by the margin; decode buckets, near
    ties and buckets no call reaches (which take the choice below) are not timed."""
    buckets = (1, 8, 32, 128, 512, 2048)
    chosen = {k: ("amx",) * 6 for k in KINDS}
    fastest = {k: ("amx",) * 4 + ("onednn", "onednn") for k in KINDS}
    fastest["o"] = ("onednn",) * 6  # a decode bucket's fastest is never timed here
    asked: list[tuple[int, dict[str, str], dict[str, str]]] = []

    def time_layer(assign: Any, rows: int) -> dict[str, float | None]:
        asked.append((rows, dict(assign["chosen"]), dict(assign["fastest"])))
        # 512 rows: a near tie (3% faster); 2,048: 10% faster
        return {"chosen": 1.0, "fastest": 0.97 if rows == 512 else 0.9}

    got = autotune.prefer_in_sequence(chosen, fastest, time_layer, buckets, margin=0.05)
    assert [r for r, _, _ in asked] == [512, 2048]
    assert asked[1][1] == dict.fromkeys(KINDS[:4], "amx")
    assert asked[1][2] == dict.fromkeys(KINDS[:4], "onednn")
    for k in KINDS[:4]:
        assert got[k][:5] == chosen[k][:5] and got[k][5] == "onednn", k
    assert got["lm_head"] == chosen["lm_head"]  # not a layer GEMM
    # no call gets past 512 rows: 2,048 is not timed and takes 512's choice (here torch, which
    # 2,048's own fastest, onednn, would not give)
    asked.clear()
    fastest = {k: ("amx",) * 4 + ("torch", "onednn") for k in KINDS}
    got = autotune.prefer_in_sequence(chosen, fastest, time_layer, buckets, max_rows=512)
    assert [r for r, _, _ in asked] == [512]
    assert all(got[k][4:] == ("amx", "amx") for k in KINDS[:4])  # 3% at 512: a near tie
    got = autotune.prefer_in_sequence(
        chosen, fastest, lambda a, r: {"chosen": 1.0, "fastest": 0.5}, buckets, max_rows=512
    )
    assert all(got[k][4:] == ("torch", "torch") for k in KINDS[:4])
    # not timed (past the deadline): the choice stands
    got = autotune.prefer_in_sequence(
        chosen, fastest, lambda a, r: {"chosen": None, "fastest": None}, buckets
    )
    assert got == chosen


def test_time_layers_runs_the_four_gemms_in_order() -> None:
    """Each assignment's sequence calls qkv, o, gate_up (then the model's act) and down on their
    input widths, on that assignment's paths."""
    import time as _time

    calls: list[tuple[str, str, tuple[int, ...]]] = []
    shapes = {"qkv": (12, 4), "o": (4, 4), "gate_up": (16, 4), "down": (4, 8)}
    weights = {k: (torch.zeros(n, m), None) for k, (n, m) in shapes.items()}

    def gemm(kind: str, path: str) -> Any:
        def run(x: torch.Tensor) -> torch.Tensor:
            calls.append((kind, path, tuple(x.shape)))
            return torch.zeros(x.shape[0], shapes[kind][0])

        return run

    fns = {k: {p: gemm(k, p) for p in ("a", "b")} for k in shapes}

    def act(y: torch.Tensor) -> torch.Tensor:
        calls.append(("act", "-", tuple(y.shape)))
        return y[:, : y.shape[1] // 2]

    assign = {"x": {"qkv": "a", "o": "b", "gate_up": "a", "down": "b"}}
    got = autotune.time_layers(weights, fns, act, _time.perf_counter() + 60, assign, 3)
    assert got["x"] is not None and got["x"] > 0
    one = [
        ("qkv", "a", (3, 4)), ("o", "b", (3, 4)), ("gate_up", "a", (3, 4)), ("act", "-", (3, 16)),
        ("down", "b", (3, 8)),
    ]  # fmt: skip
    assert calls == one * 4  # a warm-up call and three timed (time_paths)


def test_measure_gemms_times_the_lm_head_as_f32_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LM head is timed as the model runs it (layers.linear_f32): a path that returns bf16
    logits is timed with their f32 copy, a pair GEMM through its f32 output; the other kinds
    as they are."""
    import time as _time

    seen: dict[str, list[torch.dtype]] = {}

    def fake_time_paths(calls: Any, deadline: float, reps: int = 3) -> Any:
        for p, fn in calls.items():
            seen.setdefault(p, []).append(fn().dtype)
        return dict.fromkeys(calls, 1.0)

    monkeypatch.setattr(autotune, "time_paths", fake_time_paths)

    def bf16(w: Any, b: Any) -> Any:
        return lambda x: x.to(torch.bfloat16)

    w = torch.zeros(4, 4)
    autotune.measure_gemms(
        {"qkv": (w, None), "lm_head": (w, None)},
        {"torch": bf16},
        {"qkv": 1, "lm_head": 1},
        _time.perf_counter() + 60,
    )
    # bucket 1 only (max_rows 1): qkv first, then the LM head
    assert seen["torch"] == [torch.bfloat16, torch.float32]


def test_measure_gemms_times_gate_up_with_the_models_act(monkeypatch: pytest.MonkeyPatch) -> None:
    """gate_up is timed followed by the activation the model applies to it (layers.GateUpAct):
    a path whose output the model passes through a separate SwiGLU pays for it in its timing;
    the other kinds are timed as GEMMs alone."""
    import time as _time

    acted: list[tuple[int, ...]] = []

    def act(y: torch.Tensor) -> torch.Tensor:
        acted.append(tuple(y.shape))
        return y[:, : y.shape[1] // 2]

    shapes: dict[str, list[tuple[int, ...]]] = {}

    def fake_time_paths(calls: Any, deadline: float, reps: int = 3) -> Any:
        for p, fn in calls.items():
            shapes.setdefault(p, []).append(tuple(fn().shape))
        return dict.fromkeys(calls, 1.0)

    monkeypatch.setattr(autotune, "time_paths", fake_time_paths)

    def linear(w: torch.Tensor, b: Any) -> Any:
        return lambda x: x @ w.T

    up, o = torch.zeros(8, 4), torch.zeros(4, 4)
    autotune.measure_gemms(
        {"o": (o, None), "gate_up": (up, None)},
        {"torch": linear},
        {"o": 1, "gate_up": 1},
        _time.perf_counter() + 60,
        act,
    )
    # bucket 1 only: o as a GEMM ([1, 4]), gate_up through the act ([1, 8] -> [1, 4])
    assert shapes["torch"] == [(1, 4), (1, 4)] and acted == [(1, 8)]


@pytest.mark.parametrize("path", ["pairs", "amx"])
def test_gate_up_is_timed_with_the_fused_swiglu_on_a_pair_gemm(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Where a pair GEMM runs gate_up, the timed call is the one the model makes: SwiGLU in the
    GEMM's epilogue (gemm_swiglu) from epilogue_min_rows on (1 row on dot products,
    EPILOGUE_MIN_ROWS on AMX tiles), the same bits as the GEMM followed by silu_mul."""
    kern = kernels.load()
    if kern is None or not (kern.has_amx if path == "amx" else kern.has_bf16_dot):
        pytest.skip(f"needs the C++ kernels with the {path} GEMM on this CPU")
    builders = autotune.gemm_builders(torch.bfloat16, kern, pack=False)
    w = (torch.randn(64, 64) * 0.1).bfloat16()
    lin = builders[path](w, None)
    act = FusedSiluMul(kern, GLU_BLOCK)
    called: list[int] = []
    real = kern.gemm_swiglu

    def spy(x: torch.Tensor, *a: Any, **k: Any) -> Any:
        assert k["amx"] == (path == "amx")
        called.append(len(x))
        return real(x, *a, **k)

    monkeypatch.setattr(kern, "gemm_swiglu", spy)
    least = EPILOGUE_MIN_ROWS if path == "amx" else 1
    assert epilogue_min_rows(lin) == least
    for rows in range(max(1, least - 1), least + 1):
        x = torch.randn(rows, 64).bfloat16()
        got = GateUpAct(lin, act)(x)
        assert torch.equal(got, kern.silu_mul(lin(x), GLU_BLOCK))
    assert called == [least]
    # an act that takes gate_up as [gate | up] never gets the epilogue, whose weight must be in
    # GLU_BLOCK's layout
    called.clear()
    plain = GateUpAct(lin, FusedSiluMul(kern, 0))
    x = torch.randn(EPILOGUE_MIN_ROWS, 64).bfloat16()
    assert plain.epilogue_at(EPILOGUE_MIN_ROWS) is None
    assert torch.equal(plain(x), kern.silu_mul(lin(x))) and called == []


def test_choose_glu_keeps_the_epilogue_unless_the_separate_pass_clearly_wins() -> None:
    """``pick`` with the epilogue as the baseline and no near-tie margin: the separate SwiGLU
    pass where it beats the epilogue by MARGIN, or where it is faster at all and most buckets
    chose it; never where it is slower; untimed buckets carry the neighbour's; near ties
    everywhere keep the epilogue."""
    fast = [None, None, 1.0, 1.0, 1.0, None]
    t = {"epilogue": fast, "separate": [None, None, 0.7, 0.98, 0.7, None]}
    assert autotune.choose_glu(t) == (True, True, False, False, False, False)
    t = {"epilogue": fast, "separate": [None, None, 0.7, 1.12, 0.7, None]}
    assert autotune.choose_glu(t) == (True, True, False, True, False, False)
    t = {"epilogue": fast, "separate": [None, None, 0.7, 1.3, 1.2, None]}
    assert autotune.choose_glu(t) == (True, True, False, True, True, True)
    same = {"epilogue": [1.0] * 6, "separate": [0.97] * 6}
    assert autotune.choose_glu(same) == (True,) * 6


def test_epilogue_rule_follows_the_row_buckets() -> None:
    """A call of m rows takes the entry of the bucket that serves m rows (bucket_limits)."""
    glu = (True, True, False, True, True, False)
    rule = autotune.epilogue_rule(glu)
    limits = autotune.bucket_limits(ROW_BUCKETS)
    for i, limit in enumerate(limits[:-1]):
        assert rule(limit) == glu[i] and rule(limit + 1) == glu[i + 1]
    assert rule(10**6) is False


def test_gate_up_takes_the_separate_pass_where_the_rule_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GateUpAct with an epilogue rule: the separate pass (GEMM, then silu_mul) where the rule
    says no, gemm_swiglu where it says yes; the same bits either way."""
    kern = kernels.load()
    if kern is None or not kern.has_bf16_dot:
        pytest.skip("needs the C++ kernels built with AVX512-BF16 on this CPU")
    path = "amx" if kern.has_amx else "pairs"
    lin = autotune.gemm_builders(torch.bfloat16, kern, pack=False)[path](
        (torch.randn(64, 64) * 0.1).bfloat16(), None
    )
    called: list[int] = []
    real = kern.gemm_swiglu
    monkeypatch.setattr(
        kern, "gemm_swiglu", lambda x, *a, **k: called.append(len(x)) or real(x, *a, **k)
    )
    gu = GateUpAct(lin, FusedSiluMul(kern, GLU_BLOCK), lambda rows: rows >= 32)
    for rows in (EPILOGUE_MIN_ROWS, 32):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(gu(x), kern.silu_mul(lin(x), GLU_BLOCK))
        assert (gu.epilogue_at(rows) is not None) == (rows >= 32)
    assert called == [32]


def test_measure_glu_times_both_forms_where_asked() -> None:
    """Both forms timed at the given row counts, None elsewhere."""
    kern = kernels.load()
    if kern is None or not kern.has_bf16_dot:
        pytest.skip("needs the C++ kernels built with AVX512-BF16 on this CPU")
    lin = autotune.gemm_builders(torch.bfloat16, kern, pack=False)["pairs"](
        (torch.randn(64, 32) * 0.1).bfloat16(), None
    )
    at: list[tuple[int, Any] | None] = [None, None, (32, lin), None, None, None]
    got = autotune.measure_glu(32, torch.bfloat16, at, FusedSiluMul(kern, GLU_BLOCK), 1e18)
    for form in ("epilogue", "separate"):
        assert [t is not None for t in got[form]] == [e is not None for e in at]


def test_glu_setting_fixes_the_swiglu_form_without_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ITERSERVE_KERNELS' glu= gives the form at every bucket, in a fixed choice and beside
    measured GEMMs alike, and measure_glu is not called."""
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))

    def no_glu(*a: Any) -> Any:
        raise AssertionError("measure_glu called under glu=")

    monkeypatch.setattr(autotune, "measure_glu", no_glu)
    monkeypatch.setattr(
        autotune, "measure_gemms", lambda w, *a: {k: {"torch": [1.0] * 6} for k in w}
    )
    monkeypatch.setattr(autotune, "measure_decodes", lambda *a: {"cpu": [1.0] * 4})
    builders = autotune.gemm_builders(torch.float32, None, pack=False)
    kern: Any = object()  # never called
    fixed = autotune.choose(
        _problem(), builders, kern, True, Setting(gemm="torch", attn="cpu", glu="separate")
    )
    assert fixed.source == "fixed" and fixed.glu == (False,) * len(ROW_BUCKETS)
    measured = autotune.choose(_problem(), builders, kern, True, Setting(glu="epilogue"))
    assert measured.source == "measured" and measured.glu == (True,) * len(ROW_BUCKETS)


def test_busy_measurement_is_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Timings taken while other processes kept BUSY_CORES or more busy are used for this start
    but not cached: the next start measures again, and caches once the machine is quiet."""
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    calls: list[str] = []

    def fake_gemms(weights: Any, builders: Any, max_rows: Any, deadline: float, *_: Any) -> Any:
        calls.append("gemm")
        return {k: {"torch": [1.0] * 6, "packed": [0.5] * 6} for k in weights}

    monkeypatch.setattr(autotune, "measure_gemms", fake_gemms)
    monkeypatch.setattr(autotune.OtherLoad, "cores", lambda self, reset=False: 0.9)
    builders = autotune.gemm_builders(torch.float32, None, pack=True)
    fixed = Setting(attn="torch")
    with caplog.at_level("WARNING", logger="iterserve.model.autotune"):
        got = autotune.choose(_problem(), builders, None, True, fixed)
    assert got.source == "measured" and set(got.gemm["qkv"]) == {"packed"}
    assert "other processes took 0.9 cores" in caplog.text
    assert autotune.choose(_problem(), builders, None, True, fixed).source == "measured"
    monkeypatch.setattr(autotune.OtherLoad, "cores", lambda self, reset=False: 0.1)
    assert autotune.choose(_problem(), builders, None, True, fixed).source == "measured"
    assert autotune.choose(_problem(), builders, None, True, fixed).source == "cached"
    assert calls == ["gemm"] * 3


def test_a_measurement_cut_past_the_decode_buckets_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The GEMMs get GEMM_SHARE of the budget. A budget that cut only their larger buckets (a
    large model's) leaves the choice cached, with a warning; one that cut a decode-sized
    bucket, or the attention paths (here with the GEMMs fixed), leaves it uncached."""
    import time as _time

    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    cut_at: list[int] = []
    deadlines: list[float] = []

    def fake_gemms(weights: Any, builders: Any, max_rows: Any, deadline: float, *rest: Any) -> Any:
        deadlines.append(deadline)
        rest[-1].update(cut_at)  # measure_gemms' `cut`: the buckets the deadline cut
        ts: list[float | None] = [1.0] * 4 + [None if 4 in cut_at else 1.0] * 2
        return {k: {"torch": ts, "packed": ts} for k in weights}

    monkeypatch.setattr(autotune, "measure_gemms", fake_gemms)
    monkeypatch.setattr(
        autotune, "measure_decodes", lambda *a: {"cpu": [1.0] * 4, "torch": [0.5] * 4}
    )
    builders = autotune.gemm_builders(torch.float32, None, pack=True)

    def start(setting: Setting | None = None, budget_s: float = 5.0) -> Choice:
        fixed = setting or Setting()
        return autotune.choose(_problem(), builders, object(), True, fixed, budget_s=budget_s)  # type: ignore[arg-type]

    cut_at[:] = [4]  # 512 rows
    t0 = _time.perf_counter()
    with caplog.at_level("WARNING", logger="iterserve.model.autotune"):
        got = start()
    assert 5.0 * autotune.GEMM_SHARE <= deadlines[-1] - t0 < 5.0  # the GEMMs' share only
    assert got.attn == ("torch",) * 4 and "cached all the same" in caplog.text
    assert len(list(tmp_path.glob("autotune/*.json"))) == 1
    for f in tmp_path.glob("autotune/*.json"):
        f.unlink()
    caplog.clear()
    cut_at[:] = [2]  # 32 rows: a decode-sized bucket
    with caplog.at_level("WARNING", logger="iterserve.model.autotune"):
        start()
    assert "not cached" in caplog.text and not list(tmp_path.glob("autotune/*.json"))
    caplog.clear()
    # the GEMMs fixed, the attention paths cut by the budget
    with caplog.at_level("WARNING", logger="iterserve.model.autotune"):
        start(Setting(gemm="torch"), budget_s=0.0)
    assert "not cached" in caplog.text and not list(tmp_path.glob("autotune/*.json"))


def test_route_by_rows() -> None:
    limits = autotune.bucket_limits(ROW_BUCKETS)
    assert limits[:-1] == (2, 16, 64, 256, 1024) and limits[-1] > 10**9  # log-scale midpoints
    made: list[str] = []

    def make(p: str) -> Any:
        made.append(p)
        return lambda x: p

    fn = autotune.route(("a", "a", "b", "b", "a", "a"), ROW_BUCKETS, make)
    assert sorted(made) == ["a", "b"]  # each path built once
    rows = {m: fn(torch.empty(m, 1)) for m in (1, 2, 3, 16, 17, 64, 256, 257, 5000)}
    assert rows == {
        1: "a",
        2: "a",
        3: "a",
        16: "a",
        17: "b",
        64: "b",
        256: "b",
        257: "a",
        5000: "a",
    }
    one = autotune.route(("c",) * 6, ROW_BUCKETS, make)
    assert one(torch.empty(1, 1)) == "c" and not isinstance(one, autotune.ByRows)
    assert (
        autotune.describe(("a", "a", "b", "b", "a", "a"), ROW_BUCKETS)
        == "a up to 16, b up to 256, a above"
    )
    assert autotune.describe(("c",) * 6, ROW_BUCKETS) == "c at every count"


def test_decode_router_paths() -> None:
    """Each decode attention path of the choice routes to what it names: the kernel with its
    default prefetch into L1, into L2, without software prefetch; SDPA."""
    from iterserve.model import attention, kernels

    kern = object()
    fn = autotune.decode_router(kern, ("torch", "cpu_nopf", "cpu_l2", "cpu"))  # type: ignore[arg-type]
    picked = [fn.pick(d) for d in (1, 8, 32, 128)]
    assert picked[0] is attention.sdpa_decodes
    for p, want in zip(picked[1:], ({"prefetch": 0}, {"prefetch_l2": True}, {})):
        assert p.func is attention.kernel_decodes and p.args == (kern,) and p.keywords == want
    assert set(kernels.ATTN_PATHS) == {"cpu", "cpu_l2", "cpu_nopf", "torch"}


def test_setting_parsing() -> None:
    assert parse_setting("1") == parse_setting("measure") == parse_setting(" ") == Setting()
    assert parse_setting("0") == Setting(enabled=False)
    assert parse_setting("flags") == Setting(mode="flags")
    assert parse_setting("gemm=panels,attn=cpu") == Setting(gemm="panels", attn="cpu")
    assert parse_setting("ATTN=torch") == Setting(attn="torch")
    assert parse_setting("prefill=torch,attn=cpu_nopf") == Setting(attn="cpu_nopf", prefill="torch")
    assert parse_setting("glu=separate,gemm=amx") == Setting(gemm="amx", glu="separate")
    assert parse_setting("lmhead=full") == Setting(lm_head="full")
    assert parse_setting("gemm=pairs,lmhead=screen") == Setting(gemm="pairs", lm_head="screen")
    assert parse_setting("w12=off,lmhead=full") == Setting(lm_head="full", w12="off")
    assert parse_setting("W12=on") == Setting(w12="on")
    for bad in ("yes", "gemm=fast", "gemm=panels,gemm=torch", "attn", "gemm=torch;attn=cpu", "2",
                "prefill=sdpa", "prefill=cpu,prefill=torch", "glu=fused", "lmhead=int8",
                "lmhead=full,lmhead=screen", "w12=12", "w12=on,w12=off"):  # fmt: skip
        with pytest.raises(ValueError, match="ITERSERVE_KERNELS must be 0 .*gemm=<torch"):
            parse_setting(bad)


def _choice() -> Choice:
    gemm = {k: ("torch", "torch", "panels", "packed", "packed", "packed") for k in KINDS}
    glu = (True, True, False, False, True, True)
    return Choice(gemm, ("cpu", "cpu", "torch", "torch"), prefill=("torch",), glu=glu)


def test_cache_round_trip(tmp_path: Path) -> None:
    key = {"cpu": "x", "threads": 2, "shapes": {"qkv": [3, 4]}}
    assert autotune.load_cached(key, tmp_path) is None
    path = autotune.save(key, _choice(), tmp_path)
    back = autotune.load_cached(key, tmp_path)
    assert back is not None and back.source == "cached"
    assert back.gemm == _choice().gemm and back.attn == _choice().attn
    assert back.prefill == ("torch",) and back.glu == _choice().glu
    assert autotune.load_cached({**key, "threads": 1}, tmp_path) is None  # another key
    d = json.loads(path.read_text())
    d["choice"]["gemm"]["qkv"] = ["warp"] * len(ROW_BUCKETS)
    path.write_text(json.dumps(d))
    assert autotune.load_cached(key, tmp_path) is None  # not a valid choice: measured again
    d["choice"]["gemm"]["qkv"] = list(_choice().gemm["qkv"])
    d["choice"]["glu"] = [True]  # one entry per bucket, or none
    path.write_text(json.dumps(d))
    assert autotune.load_cached(key, tmp_path) is None
    path.write_text("{not json")
    assert autotune.load_cached(key, tmp_path) is None


def _problem() -> autotune.Problem:
    w = torch.randn(8, 16)
    return autotune.Problem(
        weights={k: (w, None) for k in KINDS},
        dtype=torch.float32,
        max_rows={**dict.fromkeys(KINDS, 512), "lm_head": 128},
        heads=2,
        kv_heads=1,
        head_dim=8,
        block_size=4,
        max_decodes=128,
        max_ctx=64,
    )


def test_choose_measures_once_then_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake timings in, the picked choice out and cached; the second start does not measure."""
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    calls = []

    def fake_gemms(weights: Any, builders: Any, max_rows: Any, deadline: float, *_: Any) -> Any:
        calls.append("gemm")
        fake = {"torch": [1.0] * 6, "packed": [2.0, 2.0, 0.5, 0.5, 0.5, 0.5]}
        return {k: fake for k in weights}

    def fake_decodes(*args: Any) -> Any:
        calls.append("attn")
        return {"cpu": [1.0, 1.0, 1.0, 1.0], "torch": [0.5, 2.0, 2.0, 2.0]}

    monkeypatch.setattr(autotune, "measure_gemms", fake_gemms)
    monkeypatch.setattr(autotune, "measure_decodes", fake_decodes)
    builders = autotune.gemm_builders(torch.float32, None, pack=True)
    assert list(builders) == ["torch", "packed"]
    kern = object()  # never called: timings are fake
    got = autotune.choose(_problem(), builders, kern, True, Setting())  # type: ignore[arg-type]
    assert got.source == "measured" and calls == ["gemm", "attn"]
    assert got.gemm["o"] == ("torch", "torch", "packed", "packed", "packed", "packed")
    assert got.attn == ("torch", "cpu", "cpu", "cpu")
    again = autotune.choose(_problem(), builders, kern, True, Setting())  # type: ignore[arg-type]
    assert again.source == "cached" and calls == ["gemm", "attn"]
    assert again.gemm == got.gemm and again.attn == got.attn
    # A fixed gemm path measures only attention, under its own cache key.
    fixed = autotune.choose(_problem(), builders, kern, True, Setting(gemm="torch"))  # type: ignore[arg-type]
    assert set(fixed.gemm["qkv"]) == {"torch"} and calls[-1] == "attn"
    both = autotune.choose(_problem(), builders, kern, True, Setting(gemm="packed", attn="cpu"))  # type: ignore[arg-type]
    assert both.source == "fixed" and set(both.attn) == {"cpu"}


def test_choose_settles_prefill_buckets_in_sequence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In ``choose``, a prefill bucket where the near-tie rule kept the majority path is timed
    as a layer's GEMMs in sequence on both sets, at its row count, and takes the faster set;
    the decode buckets keep the near-tie rule's choice."""
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))

    def fake_gemms(weights: Any, builders: Any, max_rows: Any, deadline: float, *_: Any) -> Any:
        # packed wins every bucket; torch is 10% faster at 512 rows: a near tie for `pick`
        fake = {"torch": [2.0, 2.0, 2.0, 2.0, 0.9, 2.0], "packed": [1.0] * 6}
        return {k: fake for k in weights}

    seen: list[tuple[int, dict[str, str], dict[str, str]]] = []

    def fake_layers(w: Any, fns: Any, act: Any, deadline: float, assign: Any, rows: int) -> Any:
        assert set(fns["qkv"]) == {"torch", "packed"}  # the built GEMMs, every path
        seen.append((rows, dict(assign["chosen"]), dict(assign["fastest"])))
        return {"chosen": 1.0, "fastest": 0.8}

    monkeypatch.setattr(autotune, "measure_gemms", fake_gemms)
    monkeypatch.setattr(autotune, "time_layers", fake_layers)
    monkeypatch.setattr(autotune, "measure_decodes", lambda *a: {"cpu": [1.0] * 4})
    builders = autotune.gemm_builders(torch.float32, None, pack=True)
    got = autotune.choose(_problem(), builders, object(), True, Setting())  # type: ignore[arg-type]
    # max_rows 512: only the 512-row bucket is timed in sequence; 2,048 follows it
    assert seen == [(512, dict.fromkeys(KINDS[:4], "packed"), dict.fromkeys(KINDS[:4], "torch"))]
    for k in KINDS[:4]:
        assert got.gemm[k] == ("packed",) * 4 + ("torch", "torch"), k
    assert got.gemm["lm_head"] == ("packed",) * 6  # not a layer GEMM


def test_choose_times_prefill_where_the_kernel_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model whose head_dim the prefill kernel takes, on the cpu backend: prefill
    attention is measured (fake timings: SDPA faster, then the kernel), cached with the rest,
    and fixed by prefill=; elsewhere (f32, or no kernel) there is no prefill choice, and
    prefill=cpu is refused."""
    import dataclasses
    import types

    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    timings = {"cpu": [2.0], "torch": [1.0]}
    monkeypatch.setattr(autotune, "measure_decodes", lambda *a: {"cpu": [1.0] * 4})
    monkeypatch.setattr(autotune, "measure_prefill", lambda *a: dict(timings))
    builders = autotune.gemm_builders(torch.float32, None, pack=False)  # one path: not timed
    prob = dataclasses.replace(_problem(), dtype=torch.bfloat16, head_dim=64)
    kern = types.SimpleNamespace(has_prefill_kernel=True)
    got = autotune.choose(prob, builders, kern, True, Setting())  # type: ignore[arg-type]
    assert got.prefill == ("torch",) and got.source == "measured"
    assert "prefill attention: torch" in got.log_lines()
    timings = {"cpu": [1.0], "torch": [2.0]}
    again = autotune.choose(prob, builders, kern, True, Setting())  # type: ignore[arg-type]
    assert again.source == "cached" and again.prefill == ("torch",)  # not measured again
    other = dataclasses.replace(prob, max_ctx=128)  # another key: measured
    assert autotune.choose(other, builders, kern, True, Setting()).prefill == ("cpu",)  # type: ignore[arg-type]
    fixed = autotune.choose(prob, builders, kern, True, Setting(attn="cpu", prefill="torch"))  # type: ignore[arg-type]
    assert fixed.source == "fixed" and fixed.prefill == ("torch",)
    for p, k in ((_problem(), kern), (prob, types.SimpleNamespace(has_prefill_kernel=False))):
        assert autotune.choose(p, builders, k, True, Setting()).prefill == ()  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="prefill=cpu, which needs the cpu attention"):
            autotune.choose(p, builders, k, True, Setting(prefill="cpu"))  # type: ignore[arg-type]


def test_choose_errors_and_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    builders = autotune.gemm_builders(torch.float32, None, pack=False)
    with pytest.raises(ValueError, match="gemm=panels, which cannot run here; possible: torch"):
        autotune.choose(_problem(), builders, None, False, Setting(gemm="panels"))
    with pytest.raises(ValueError, match="attn=cpu, which needs the cpu attention backend"):
        autotune.choose(_problem(), builders, None, False, Setting(attn="cpu"))
    # Real (tiny) measurement with no time left: nothing timed, the baseline, and not cached.
    pack = autotune.gemm_builders(torch.float32, None, pack=True)
    got = autotune.choose(_problem(), pack, None, False, Setting(), budget_s=0.0)
    assert all(set(v) == {"torch"} for v in got.gemm.values()) and got.attn == ()
    assert not list(tmp_path.glob("autotune/*.json"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_measures_and_stays_exact(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real measurement on the tiny model (milliseconds per path), cached and logged; the
    measured model's greedy tokens equal those with the torch paths fixed."""
    from iterserve.config import CacheConfig
    from iterserve.model.runner import BatchItem, ModelRunner

    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("ITERSERVE_KERNELS", "measure")
    cc = CacheConfig(num_kv_blocks=16)
    runner = ModelRunner("tiny-random", dtype=dtype, cache_config=cc)
    assert runner.kernel_choice is not None and runner.kernel_choice.source == "measured"
    assert len(list(tmp_path.glob("autotune/choice-*.json"))) == 1
    again = ModelRunner("tiny-random", dtype=dtype, cache_config=cc)
    assert again.kernel_choice is not None and again.kernel_choice.source == "cached"
    monkeypatch.setenv("ITERSERVE_KERNELS", "gemm=torch,attn=torch")
    ref = ModelRunner("tiny-random", dtype=dtype, cache_config=cc)
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    outs = []
    for r in (runner, ref):
        tokens = list(ids)
        r.execute([BatchItem("a", tokens[:-1], 0, [0, 1, 2, 3], False)])
        for _ in range(6):
            logits = r.execute([BatchItem("a", tokens[-1:], len(tokens) - 1, [0, 1, 2, 3], True)])
            tokens.append(int(logits[0].argmax()))
        outs.append(tokens)
    assert outs[0] == outs[1]
    assert set(DECODE_BUCKETS) and runner.attention.name == "cpu" if kernels.load() else True


def test_choose_glu_times_each_bucket_on_its_own_pair_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """_choose_glu times the epilogue at each bucket on the pair GEMM the measured choice gave
    gate_up there (dot products from 1 row, AMX tiles from EPILOGUE_MIN_ROWS), at the bucket's
    row count; buckets on another path, under the AMX floor or past the most rows a call gets
    are not timed and keep the epilogue."""
    from iterserve.model.layers import AmxLinear, PairLinear

    pairs, amx = object.__new__(PairLinear), object.__new__(AmxLinear)
    for lin in (pairs, amx):
        lin.odd = False
    fns: dict[str, dict[str, Any]] = {"gate_up": {"pairs": pairs, "amx": amx, "torch": object()}}
    gemm = {"gate_up": ("pairs", "amx", "amx", "torch", "pairs", "amx")}
    seen: list[list[Any]] = []

    def fake_measure(x_cols: int, dtype: Any, at: Any, act: Any, deadline: float) -> Any:
        seen.append(list(at))
        times = {32: (1.0, 0.5)}  # the separate pass clearly wins at 32 rows only
        return {
            form: [None if e is None else times.get(e[0], (1.0, 2.0))[j] for e in at]
            for j, form in enumerate(("epilogue", "separate"))
        }

    monkeypatch.setattr(autotune, "measure_glu", fake_measure)
    prob = dataclasses.replace(_problem(), gate_up_act=FusedSiluMul(None, GLU_BLOCK))  # type: ignore[arg-type]
    got = autotune._choose_glu(prob, fns, gemm, 1e18)
    assert seen == [[(1, pairs), None, (32, amx), None, (512, pairs), None]]
    assert got == (True, True, False, True, True, True)
    # the act in [gate | up] (no block layout): nothing to time
    plain = dataclasses.replace(prob, gate_up_act=FusedSiluMul(None, 0))  # type: ignore[arg-type]
    assert autotune._choose_glu(plain, fns, gemm, 1e18) == () and len(seen) == 1
