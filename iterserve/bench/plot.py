"""``iterserve plot {curves,cdf,timeline} INPUT... --out FILE.png`` (matplotlib, Agg).

curves    p50/p99 TTFT and TPOT against achieved throughput, one line per policy, from
          sweep result files
cdf       latency CDFs (TTFT, TPOT, E2E) per run, from result files
timeline  the batch timeline of runs: which requests ran in each step (prefill / decode),
          tokens per step, KV-cache usage and queue length; from step records (JSON lines
          of StepStats written by ``engine.record_steps`` / ``--record-steps DIR``) or from
          result files whose runs name their step records (then request arrivals show too)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from iterserve.workload.results import (  # noqa: E402
    check_output,
    rate_value,
    read_result,
    run_timings,
)

PREFILL_COLOR = "#e6550d"
DECODE_COLOR = "#3182bd"
WAIT_COLOR = "#bdbdbd"
IDLE_COLOR = "#fb6a4a"
# The same policy gets the same colour in every picture.
POLICY_COLORS = {"static": "#d95f02", "continuous": "#1f78b4", "continuous-nochunk": "#33a02c"}
_OTHER_COLORS = ["#6a3d9a", "#e7298a", "#a6761d", "#666666", "#66a61e", "#e6ab02"]


def label_color(label: str) -> str:
    base = label.split(" @ ")[0]
    if base in POLICY_COLORS:
        return POLICY_COLORS[base]
    return _OTHER_COLORS[sum(map(ord, base)) % len(_OTHER_COLORS)]


def _save(fig: Figure, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    # a name without a suffix is written as named, in PNG (matplotlib would add ".png");
    # a suffix picks the format (.svg, .pdf, ...)
    fmt = None if Path(out).suffix else "png"
    fig.savefig(out, dpi=110, bbox_inches="tight", format=fmt)
    plt.close(fig)
    print(f"wrote {out}", file=sys.stderr)


def _rate_text(rate: float | None) -> str:
    if rate is None:
        return "trace"
    return "inf" if math.isinf(rate) else f"{rate:.3g}"


def _same_rate(run_rate: float | None, rate: float) -> bool:
    """A run at ``rate`` as the user typed it: the value, or the rounded one tables print."""
    if run_rate is None:
        return False
    return math.isclose(run_rate, rate, rel_tol=1e-3) or _rate_text(run_rate) == _rate_text(rate)


def _load_result(path: str | Path) -> dict[str, Any]:
    """A bench result file; one that is not JSON (e.g. step records, JSON lines) is an error
    that names the file and what was expected."""
    try:
        return read_result(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        hint = (
            "; step records (.jsonl) are plotted by 'iterserve plot timeline'"
            if str(path).endswith(".jsonl")
            else ""
        )
        raise ValueError(
            f"{path} is not an iterserve bench result: expected the .json file that "
            f"--result-file writes, but it is not one JSON document ({e}){hint}"
        ) from None


def _all_runs(paths: list[str]) -> list[dict[str, Any]]:
    """Every run of the files; where two files have runs of one label (the engine's and the
    simulator's "continuous"), those runs are named by their file too, so none is merged
    into another's line or dropped."""
    runs = []
    for p in paths:
        doc = _load_result(p)
        for r in doc["runs"]:
            r = dict(r)
            r["_file"] = p
            r["_rate"] = rate_value(r.get("request_rate"))
            runs.append(r)
    files_of: dict[str, set[str]] = defaultdict(set)
    for r in runs:
        files_of[r["label"]].add(r["_file"])
    stems = [Path(p).stem for p in paths]
    names = dict(zip(paths, stems if len(set(stems)) == len(stems) else paths))
    for r in runs:
        if len(files_of[r["label"]]) > 1:
            r["label"] = f"{names[r['_file']]}: {r['label']}"
    return runs


# ---- curves -----------------------------------------------------------------------------


def plot_curves(paths: list[str], out: str, x: str = "throughput") -> None:
    """Two panels (TTFT, TPOT): p50 solid and p99 dashed against achieved output throughput
    (or the offered request rate), one colour per policy, one marker per sweep point."""
    by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in _all_runs(paths):
        by_label[r["label"]].append(r)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, runs in sorted(by_label.items()):
        if x == "rate":
            runs = [r for r in runs if r["_rate"] is not None and not math.isinf(r["_rate"])]
            runs.sort(key=lambda r: r["_rate"])
            xs = [r["_rate"] for r in runs]
        else:
            # Points join in offered-rate order (inf last): the curve walks from light load to
            # overload even where the achieved throughput stops growing or falls back.
            runs.sort(
                key=lambda r: (
                    math.inf if r["_rate"] is None else r["_rate"],
                    r["summary"].get("output_throughput") or 0.0,
                )
            )
            xs = [r["summary"].get("output_throughput") or 0.0 for r in runs]
        color = label_color(label)
        for ax, metric in zip(axes, ("ttft", "tpot")):
            for pct, style in (("median", "-"), ("p99", "--")):
                ys = [r["summary"].get(f"{pct}_{metric}_ms") for r in runs]
                pts = [(a, b) for a, b in zip(xs, ys) if b is not None]
                if pts:
                    ax.plot(
                        *zip(*pts),
                        style,
                        marker="o",
                        color=color,
                        ms=4,
                        label=f"{label} {'p50' if pct == 'median' else 'p99'}",
                    )
                # All-at-once runs (rate inf) get a star: the end of the sweep, not a rate.
                inf_pts = [
                    (a, b)
                    for a, b, r in zip(xs, ys, runs)
                    if b is not None and r["_rate"] is not None and math.isinf(r["_rate"])
                ]
                if inf_pts:
                    ax.plot(*zip(*inf_pts), "*", color=color, ms=11)
    for ax, metric in zip(axes, ("TTFT", "TPOT")):
        ax.set_xlabel(
            "achieved output throughput (tokens/s)"
            if x != "rate"
            else "offered request rate (req/s)"
        )
        ax.set_ylabel(f"{metric} (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"{metric}: p50 (solid), p99 (dashed); star = all at once")
        ax.legend(fontsize=8)
    fig.suptitle("Latency vs throughput across the request-rate sweep")
    _save(fig, out)


# ---- cdf --------------------------------------------------------------------------------


def _pick_cdf_runs(runs: list[dict[str, Any]], rate: float | None) -> list[dict[str, Any]]:
    """``rate`` given: the runs at that rate. Otherwise every run of a label that has one
    run, and for labels with several (a sweep) the run at the highest finite rate."""
    if rate is not None:
        picked = [r for r in runs if _same_rate(r["_rate"], rate)]
        if not picked:
            have = sorted({_rate_text(r["_rate"]) for r in runs})
            raise ValueError(f"no run at rate {rate}; the inputs have rates {have}")
        return picked
    by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        by_label[r["label"]].append(r)
    picked = []
    for group in by_label.values():
        if len(group) == 1:
            picked.append(group[0])
            continue
        finite = [r for r in group if r["_rate"] is not None and not math.isinf(r["_rate"])]
        picked.append(max(finite, key=lambda r: r["_rate"]) if finite else group[0])
    return picked


def plot_cdf(paths: list[str], out: str, rate: float | None = None, log_x: bool = False) -> None:
    runs = _pick_cdf_runs(_all_runs(paths), rate)
    names = ("TTFT", "TPOT", "E2E latency")
    per_panel: list[list[tuple[str, np.ndarray]]] = [[], [], []]
    for r in runs:
        ok = [t for t in run_timings(r) if t.success]
        values = (
            [t.ttft for t in ok if t.ttft is not None],
            [v for t in ok if (v := t.tpot) is not None],
            [t.latency for t in ok if t.latency is not None],
        )
        label = (
            r["label"]
            if len({x["_rate"] for x in runs}) == 1
            else f"{r['label']} @ {_rate_text(r['_rate'])}"
        )
        for panel, vals in zip(per_panel, values):
            if vals:
                panel.append((label, np.sort(np.asarray(vals, dtype=float))))
    one_run_per_label = len({r["label"] for r in runs}) == len(runs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, name, panel in zip(axes, names, per_panel):
        # Milliseconds unless the values run to tens of seconds.
        big = any(arr[-1] > 10.0 for _, arr in panel)
        scale, unit = (1.0, "s") if big else (1000.0, "ms")
        for label, arr in panel:
            ax.step(
                arr * scale,
                np.arange(1, len(arr) + 1) / len(arr),
                where="post",
                label=label,
                color=label_color(label) if one_run_per_label else None,
            )
        ax.set_xlabel(f"{name} ({unit})")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.01)
        if log_x:
            ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        if panel:
            ax.legend(fontsize=8)
    rates = sorted({_rate_text(r["_rate"]) for r in runs})
    fig.suptitle(f"Latency CDFs (request rate: {', '.join(rates)} req/s)")
    _save(fig, out)


# ---- timeline ---------------------------------------------------------------------------


@dataclass
class Timeline:
    """One run's steps, times relative to ``t0`` (the run start, else the first step)."""

    label: str
    steps: list[dict[str, Any]]
    t0: float
    arrivals: dict[str, float] = field(default_factory=dict)  # request id -> arrival (s after t0)
    max_num_seqs: int | None = None  # batch slots; None: the largest batch seen

    @property
    def end(self) -> float:
        last = self.steps[-1]
        return last["start_time"] + last["duration_s"] - self.t0


def read_steps(path: str | Path) -> list[dict[str, Any]]:
    steps = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    steps.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}, line {n}: not a step record ({e}); expected the JSON lines "
                        "that --record-steps writes"
                    ) from None
    if not steps:
        raise ValueError(f"{path} holds no step records")
    if "scheduled" not in steps[0]:
        raise ValueError(
            f"{path}: step records have no 'scheduled' field; record them with engine.record_steps"
        )
    return steps


def load_timelines(
    paths: list[str], labels: list[str] | None = None, rate: float | None = None
) -> list[Timeline]:
    """Step-record files (.jsonl) give one timeline each; result files (.json) give one per
    run that names a ``steps_file`` (with request arrivals, from the run's timings), or one
    per replica of a simulated run that names ``steps_files``, only the runs at request rate
    ``rate`` when it is given."""
    out: list[Timeline] = []
    for p in paths:
        if p.endswith(".jsonl"):
            steps = read_steps(p)
            out.append(Timeline(Path(p).stem, steps, steps[0]["start_time"]))
            continue
        doc = _load_result(p)
        found = False
        rates: set[str] = set()
        for run in doc["runs"]:
            files = run.get("steps_files") or [run.get("steps_file")]
            run_rate = rate_value(run.get("request_rate"))
            rates.add(_rate_text(run_rate))
            if rate is not None and not _same_rate(run_rate, rate):
                continue
            if not all(files):
                continue
            arrivals = {t["request_id"]: t["arrival_time"] for t in run.get("requests", [])}
            label = run["label"] + (
                f" @ {_rate_text(rate_value(run.get('request_rate')))} req/s"
                if doc.get("kind") == "sweep"
                else ""
            )
            slots = (run.get("engine_args") or {}).get("max_num_seqs")
            for i, sf in enumerate(files):
                sp = Path(sf)
                if not sp.is_file():
                    sp = Path(p).parent / Path(sf).name
                if len(files) > 1 and sp.is_file() and sp.stat().st_size == 0:
                    continue  # a replica the router gave no request: nothing to draw
                steps = read_steps(sp)
                t0 = run.get("clock_start")  # the simulator's is 0.0
                if t0 is None:
                    t0 = steps[0]["start_time"]
                name = f"{label} replica {i}" if len(files) > 1 else label
                out.append(Timeline(name, steps, t0, arrivals, slots))
            found = True
        if not found:
            if rate is not None and not any(
                _same_rate(rate_value(r.get("request_rate")), rate) for r in doc["runs"]
            ):
                raise ValueError(f"{p}: no run at rate {rate}; it has rates {sorted(rates)}")
            at = f" at rate {rate}" if rate is not None else ""
            raise ValueError(
                f"{p}: no run{at} names a steps_file; run the benchmark with --record-steps DIR"
            )
    if labels:
        if len(labels) != len(out):
            raise ValueError(f"--labels gave {len(labels)} names for {len(out)} timelines")
        for tl, name in zip(out, labels):
            tl.label = name
    return out


def _segments(tl: Timeline) -> tuple[list[str], dict[str, dict[bool, list[tuple[float, float]]]]]:
    """Request order (by first schedule) and, per request, (start, width) bars for prefill
    (True) and decode (False); consecutive steps of the same kind merge into one bar."""
    order: list[str] = []
    segs: dict[str, dict[bool, list[tuple[float, float]]]] = {}
    last: dict[str, tuple[int, bool]] = {}
    for s in tl.steps:
        start, dur = s["start_time"] - tl.t0, s["duration_s"]
        for rid, _n, is_prefill in s["scheduled"]:
            kinds = segs.get(rid)
            if kinds is None:
                kinds = segs[rid] = {True: [], False: []}
                order.append(rid)
            bars = kinds[bool(is_prefill)]
            prev = last.get(rid)
            if prev == (s["step"] - 1, bool(is_prefill)) and bars:
                b0, _ = bars[-1]
                bars[-1] = (b0, start + dur - b0)
            else:
                bars.append((start, dur))
            last[rid] = (s["step"], bool(is_prefill))
    return order, segs


def _stairs(tl: Timeline, key: str, fn: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(edges, values) of a per-step quantity. A step holds its value until the next step
    starts, except after a step that left the engine empty (nothing running or waiting):
    then the gap until the next step is idle and shows as zero."""
    edges: list[float] = []
    vals: list[float] = []
    for i, s in enumerate(tl.steps):
        start = s["start_time"] - tl.t0
        end = start + s["duration_s"]
        if i + 1 < len(tl.steps):
            nxt = tl.steps[i + 1]["start_time"] - tl.t0
            if s.get("num_running", 1) or s.get("num_waiting", 0):
                end = max(end, nxt)
        if edges and start > edges[-1] + 1e-9:
            vals.append(0.0)
            edges.append(start)
        if not edges:
            edges.append(start)
        vals.append(float(fn(s) if fn else s[key]))
        edges.append(end)
    return np.asarray(edges), np.asarray(vals)


def plot_timeline(
    paths: list[str],
    out: str,
    labels: list[str] | None = None,
    max_requests: int | None = None,
    rate: float | None = None,
) -> None:
    """One column per run, sharing the time axis: (1) a Gantt chart, one row per request
    (grey: waiting since arrival, orange: prefill, blue: decode); (2) prefill and decode
    tokens per step, running requests, and idle batch slots while requests wait (red);
    (3) KV-cache usage and queue length. ``max_requests`` (None or 0: all) caps the Gantt
    chart's rows."""
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"--max-requests must be >= 0 (0: all), got {max_requests}")
    tls = load_timelines(paths, labels, rate)
    ncol = len(tls)
    fig, axes = plt.subplots(
        3,
        ncol,
        figsize=(6.5 * ncol, 9),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 1.2, 1.2]},
    )
    twins: list[list[Any]] = [[], []]  # right-hand axes of the token and KV panels
    for c, tl in enumerate(tls):
        gantt, tok_ax, kv_ax = axes[0][c], axes[1][c], axes[2][c]
        order, segs = _segments(tl)
        if max_requests:
            order = order[:max_requests]
        for y, rid in enumerate(order):
            first = min(b[0] for kind in segs[rid].values() for b in kind)
            arrival = tl.arrivals.get(rid)
            if arrival is not None and first > arrival:
                gantt.plot(
                    [arrival, first], [y, y], color=WAIT_COLOR, lw=0.8, solid_capstyle="butt"
                )
            gantt.broken_barh(segs[rid][True], (y - 0.4, 0.8), color=PREFILL_COLOR, lw=0)
            gantt.broken_barh(segs[rid][False], (y - 0.4, 0.8), color=DECODE_COLOR, lw=0)
        gantt.set_ylim(len(order) - 0.5, -0.5)
        gantt.set_ylabel("request (by first step)")
        n_steps = len(tl.steps)
        gantt.set_title(f"{tl.label}: {n_steps} steps, {len(segs)} requests, {tl.end:.1f} s")

        e, pre = _stairs(tl, "num_prefill_tokens")
        _, dec = _stairs(tl, "num_decode_tokens")
        tok_ax.stairs(pre + dec, e, fill=True, color=PREFILL_COLOR)
        tok_ax.stairs(dec, e, fill=True, color=DECODE_COLOR)
        tok_ax.set_yscale("symlog", linthresh=64)  # decode steps (a few tokens) stay visible
        tok_ax.set_ylabel("tokens / step")
        seq_ax = tok_ax.twinx()
        _, running = _stairs(tl, "num_running")
        _, waiting = _stairs(tl, "num_waiting")
        slots = tl.max_num_seqs or int(max(s["num_scheduled_seqs"] for s in tl.steps))
        # Idle slots: batch slots left empty while requests wait (static batching's waste).
        idle = np.where(waiting > 0, np.maximum(slots - running, 0), 0)
        seq_ax.stairs(
            running + idle,
            e,
            baseline=running,
            fill=True,
            color=IDLE_COLOR,
            alpha=0.5,
            label="idle slots while requests wait",
        )
        seq_ax.stairs(running, e, color="black", lw=0.9, label="running requests")
        seq_ax.axhline(slots, color="black", lw=0.6, ls=":")
        seq_ax.set_ylabel(f"running (of {slots} slots)")
        seq_ax.set_ylim(bottom=0)
        twins[0].append(seq_ax)

        _, kv = _stairs(
            tl,
            "kv_blocks_used",
            lambda s: (
                100.0 * s["kv_blocks_used"] / s["kv_blocks_total"]
                if s.get("kv_blocks_total")
                else 0.0
            ),
        )
        kv_ax.stairs(kv, e, fill=True, color="#74c476", label="KV cache used (%)")
        kv_ax.set_ylabel("KV cache used (%)")
        kv_ax.set_ylim(bottom=0)
        q_ax = kv_ax.twinx()
        q_ax.stairs(waiting, e, color="#756bb1", lw=1.2, label="waiting requests")
        q_ax.set_ylabel("queue length")
        q_ax.set_ylim(bottom=0)
        twins[1].append(q_ax)
        kv_ax.set_xlabel("time since start (s)")
        if c == 0:  # one legend for the whole figure, below it, covering no data
            handles = [plt.Rectangle((0, 0), 1, 1, color=WAIT_COLOR)]
            names = ["waiting since arrival (Gantt)"]
            for ax in (gantt, tok_ax, seq_ax, kv_ax, q_ax):
                h, labels_ = ax.get_legend_handles_labels()
                handles += h
                names += labels_
            handles[1:1] = [
                plt.Rectangle((0, 0), 1, 1, color=PREFILL_COLOR),
                plt.Rectangle((0, 0), 1, 1, color=DECODE_COLOR),
            ]
            names[1:1] = ["prefill", "decode"]
            fig.legend(handles, names, loc="lower center", ncol=4, fontsize=8, frameon=False)
    # Same y ranges across columns, so heights compare at a glance.
    for group in (list(axes[1]), list(axes[2]), *twins):
        top = max(ax.get_ylim()[1] for ax in group)
        for ax in group:
            ax.set_ylim(0, top)
    for ax in axes[1]:
        ax.set_yticks([t for t in (0, 10, 100, 1000, 10000) if t <= ax.get_ylim()[1]])
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    fig.suptitle("Batch timeline: which requests ran in each step")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    _save(fig, out)


# ---- slots ------------------------------------------------------------------------------


@dataclass
class SlotBar:
    """One request's stay in a batch slot: from its first scheduled step to its last."""

    request_id: str
    slot: int
    start: float  # s after the run start
    end: float
    long: bool


def assign_slots(steps: list[dict[str, Any]], t0: float, long_ids: set[str]) -> list[SlotBar]:
    """Each request takes the lowest free slot at its first scheduled step and holds it until
    the end of its last one (a request waiting between chunks still holds its slot). A run
    without preemption never needs more slots than ``max_num_seqs``."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for s in steps:
        start = s["start_time"] - t0
        for rid, _n, _prefill in s["scheduled"]:
            first.setdefault(rid, start)
            last[rid] = start + s["duration_s"]
    bars: list[SlotBar] = []
    free_at: list[float] = []  # per slot: when it is free again
    for rid in sorted(first, key=lambda r: first[r]):
        start = first[rid]
        slot = next((i for i, t in enumerate(free_at) if t <= start + 1e-12), len(free_at))
        if slot == len(free_at):
            free_at.append(0.0)
        free_at[slot] = last[rid]
        bars.append(SlotBar(rid, slot, start, last[rid], rid in long_ids))
    return bars


def _empty_while_waiting(
    steps: list[dict[str, Any]], t0: float, bars: list[SlotBar], rows: int
) -> list[list[tuple[float, float]]]:
    """Per slot, the (start, width) spans of steps that left requests waiting while no request
    held the slot; consecutive steps merge."""
    by_slot: list[list[SlotBar]] = [[] for _ in range(rows)]
    for b in bars:
        by_slot[b.slot].append(b)  # already in start order
    nxt = [0] * rows
    cells: list[list[tuple[float, float]]] = [[] for _ in range(rows)]
    for s in steps:
        if not s.get("num_waiting", 0):
            continue
        start, dur = s["start_time"] - t0, s["duration_s"]
        mid = start + dur / 2
        for slot in range(rows):
            own = by_slot[slot]
            while nxt[slot] < len(own) and own[nxt[slot]].end < mid:
                nxt[slot] += 1
            if nxt[slot] < len(own) and own[nxt[slot]].start <= mid:
                continue  # held
            spans = cells[slot]
            if spans and abs(spans[-1][0] + spans[-1][1] - start) < 1e-3:
                spans[-1] = (spans[-1][0], start + dur - spans[-1][0])
            else:
                spans.append((start, dur))
    return cells


def plot_slots(
    runs: list[tuple[str, list[dict[str, Any]], float, int]],
    out: str,
    long_ids: set[str],
    title: str = "Who held each batch slot, step by step",
) -> None:
    """One panel per run, one above the other on a shared time axis: a row per batch slot, a
    bar per request while it holds the slot (long requests dark, short ones light), and red
    where a slot sat empty while requests waited. ``runs``: (label, step records with
    ``scheduled``, run start time, max_num_seqs)."""
    fig, axes = plt.subplots(
        len(runs),
        1,
        figsize=(12, 2.2 + 0.22 * max(r[3] for r in runs) * len(runs)),
        sharex=True,
        squeeze=False,
    )
    short_colors = ["#9ecae1", "#6baed6", "#c6dbef", "#4292c6"]
    for ax, (label, steps, t0, slots) in zip(axes[:, 0], runs):
        bars = assign_slots(steps, t0, long_ids)
        for i, b in enumerate(bars):
            color = "#a63603" if b.long else short_colors[i % len(short_colors)]
            ax.broken_barh(
                [(b.start, b.end - b.start)],
                (b.slot - 0.42, 0.84),
                facecolor=color,
                edgecolor="white",  # successive requests in one slot stay apart
                lw=0.6,
            )
        rows = max([slots] + [b.slot + 1 for b in bars])
        for slot, cells in enumerate(_empty_while_waiting(steps, t0, bars, rows)):
            ax.broken_barh(cells, (slot - 0.5, 1.0), color=IDLE_COLOR, alpha=0.35, lw=0)
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_ylabel("batch slot")
        end = max((b.end for b in bars), default=0.0)
        ax.set_title(f"{label}: {len(steps)} steps, {len(bars)} requests, {end:.1f} s", fontsize=10)
    axes[-1, 0].set_xlabel("time since the run's start (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#a63603", "#6baed6", IDLE_COLOR)]
    fig.legend(
        handles,
        ["long request", "short request", "empty slot while requests wait"],
        loc="lower center",
        ncol=3,
        fontsize=9,
        frameon=False,
    )
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    _save(fig, out)


# ---- CLI --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterserve plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="kind", required=True)
    c = sub.add_parser(
        "curves", help="p50/p99 TTFT and TPOT vs throughput per policy (sweep results)"
    )
    c.add_argument("inputs", nargs="+", metavar="RESULT.json")
    c.add_argument(
        "--x",
        choices=("throughput", "rate"),
        default="throughput",
        help="x axis: achieved output tokens/s, or offered request rate",
    )
    d = sub.add_parser("cdf", help="latency CDFs per run")
    d.add_argument("inputs", nargs="+", metavar="RESULT.json")
    d.add_argument(
        "--rate",
        type=float,
        help="use the runs at this request rate (default: each "
        "label's only run, or its highest finite rate)",
    )
    d.add_argument("--log-x", action="store_true")
    t = sub.add_parser("timeline", help="batch timeline from step records, side by side")
    t.add_argument("inputs", nargs="+", metavar="STEPS.jsonl|RESULT.json")
    t.add_argument("--labels", help="comma-separated column titles")
    t.add_argument(
        "--max-requests",
        type=int,
        help="show only the first N requests in the Gantt chart (default or 0: all)",
    )
    t.add_argument(
        "--rate", type=float, help="from result files, only the runs at this request rate"
    )
    for p in (c, d, t):
        p.add_argument("--out", required=True, metavar="FILE.png")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        check_output(ns.out, "--out")
        if ns.kind == "curves":
            plot_curves(ns.inputs, ns.out, ns.x)
        elif ns.kind == "cdf":
            plot_cdf(ns.inputs, ns.out, ns.rate, ns.log_x)
        else:
            labels = [x.strip() for x in ns.labels.split(",")] if ns.labels else None
            plot_timeline(ns.inputs, ns.out, labels, ns.max_requests, ns.rate)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
