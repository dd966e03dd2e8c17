"""What the light tenant's slowest requests wait for, in the simulator (docs/SCHEDULING.md).

    python benchmarks/tenant_waits.py cpu --profile cpu_profile.json [--prompts 120]
    python benchmarks/tenant_waits.py h100 --time-scale 0.25       # examples/two_tenants.py's

Runs the two-tenant workload (heavy:light 10:1) with observing hooks on every step: for each
light request between its arrival and its first token, each step's time goes to one cause:

  arrived mid-step   it arrived while a step ran (the scheduler sees it only after)
  no slot           waiting, and max_num_seqs requests were running after the step's decision
  budget: decodes / budget: prefills   waiting with every budget token taken (by running
                    decodes, or by prefill chunks of other requests: each its share of the
                    step's time), or running and sharing the step with those
  kv blocks         waiting, budget and slot left, but the pool could not hold its prompt
  queue             waiting for another reason (behind a waiting request, or the policy deferred)
  own prefill       running: the share of the step's time that its own chunk's tokens took
                    (the decodes' and other prefills' shares go to the budget causes)

Prints, per policy, the totals over all light requests and over the slowest 1% (at least 3),
and the slowest requests one by one. ``fair`` without each of its parts, for comparisons
(``--policies fair,tenant_waits:FairDecodesFirst``; also ``examples/two_tenants.py
--policies``, with ``benchmarks`` on PYTHONPATH): ``FairDecodesFirst``,
``FairDecodesToFinish``, ``FairNoSlotPreemption``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scheduling as S  # noqa: E402

from iterserve.config import EngineArgs, SchedulerConfig  # noqa: E402
from iterserve.core.policies import FairPolicy  # noqa: E402
from iterserve.core.request import Request, RequestStatus  # noqa: E402
from iterserve.core.scheduler import Scheduler  # noqa: E402
from iterserve.sim import simulator as simmod  # noqa: E402
from iterserve.sim.simulator import SimConfig, Simulator  # noqa: E402
from iterserve.workload.datasets import RequestSpec  # noqa: E402

CAUSES = (
    "arrived mid-step",
    "no slot",
    "budget: decodes",
    "budget: prefills",
    "kv blocks",
    "queue",
    "own prefill",
)


class Observer:
    """Patches the simulator's step start to charge each step's time per pending light
    request (see the module docstring)."""

    def __init__(self, specs: list[RequestSpec], light: str = "light") -> None:
        self.specs = specs
        self.light = light
        self.books: dict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.pending: dict[int, Request] = {}  # light requests without a first token
        self.arrived: list[Request] = []  # light requests added since the last step
        self.trace = False  # keep each pending light request's steps, as text
        self.steps: dict[int, list[str]] = collections.defaultdict(list)

    def install(self) -> Any:
        orig_start, orig_add = simmod._Replica.start_step, Scheduler.add_request
        obs = self

        def start_step(rep: Any, now: float) -> list[Request]:
            failed = orig_start(rep, now)
            obs.on_step(rep, now)
            return failed

        def add_request(sch: Scheduler, req: Request) -> None:
            orig_add(sch, req)
            if req.tenant == obs.light:
                obs.arrived.append(req)

        simmod._Replica.start_step = start_step  # type: ignore[method-assign]
        Scheduler.add_request = add_request  # type: ignore[method-assign]

        def undo() -> None:
            simmod._Replica.start_step = orig_start  # type: ignore[method-assign]
            Scheduler.add_request = orig_add  # type: ignore[method-assign]

        return undo

    def on_step(self, rep: Any, now: float) -> None:
        sch = rep.scheduler
        cfg: SchedulerConfig = sch.config
        step = rep.step
        for req in self.arrived:
            i = int(req.request_id.rsplit("-", 1)[-1])  # the simulator names them PREFIX-INDEX
            self.pending[i] = req
            # The time between its arrival and this step's start went by inside a step.
            self.books[i]["arrived mid-step"] += now - self.specs[i].arrival_time
        self.arrived.clear()
        if step is None:
            return
        out = step.out
        dt = step.duration_s
        if self.trace:
            for i in self.pending:
                self.steps[i].append(
                    f"{now:.3f}+{dt:.3f}: "
                    + " ".join(
                        f"{r.tenant[0]}{r.request_id.rsplit('-', 1)[-1]}:{n}"
                        for r, n in zip(out.requests, out.num_tokens)
                        if n > 1 or r.tenant == self.light
                    )
                    + f" +{out.num_decode_tokens} decodes, {len(sch.running)} running,"
                    f" {len(sch.waiting)} waiting"
                    + "".join(
                        f" {t}={v:.0f}" for t, v in getattr(sch.policy, "counters", {}).items()
                    )
                )
        got = dict(zip((id(r) for r in out.requests), out.num_tokens))
        decode_tok = out.num_decode_tokens
        budget = cfg.max_num_batched_tokens
        full = out.total_tokens >= budget
        for i, req in list(self.pending.items()):
            if req.status is RequestStatus.FINISHED:
                del self.pending[i]
                continue
            b = self.books[i]
            if req.status is RequestStatus.RUNNING and id(req) in got:
                # Its own chunk ran: the step's time splits by tokens between its chunk,
                # the decodes and the other prefill chunks that shared the step.
                n = got[id(req)]
                total = out.total_tokens
                b["own prefill"] += dt * n / total
                b["budget: decodes"] += dt * decode_tok / total
                b["budget: prefills"] += dt * (out.num_prefill_tokens - n) / total
                if len(req.all_token_ids) <= req.num_computed_tokens + n:
                    del self.pending[i]  # its first token comes at this step's end
                continue
            if len(sch.running) >= cfg.max_num_seqs and req.status is not RequestStatus.RUNNING:
                b["no slot"] += dt
            elif full or req.status is RequestStatus.RUNNING:
                b["budget: decodes"] += dt * decode_tok / out.total_tokens
                b["budget: prefills"] += dt * out.num_prefill_tokens / out.total_tokens
            elif rep.kv.blocks_for(req.num_tokens + 1) > rep.kv.num_free_blocks:
                b["kv blocks"] += dt
            else:
                b["queue"] += dt


class FairDecodesFirst(FairPolicy):
    """``fair`` whose decodes never make way for prefills (as before this fix)."""

    def defer_decode(self, req: Request) -> bool:
        return False


class FairDecodesToFinish(FairPolicy):
    """``fair`` whose decodes make way only when that lets the first-ranked tenants'
    prefill work end within the step."""

    def on_schedule(self, running: Any, waiting: Any) -> None:
        super().on_schedule(running, waiting)
        todo = [r for r in running if len(r.all_token_ids) - r.num_computed_tokens > 1]
        first = sum(
            len(r.all_token_ids) - r.num_computed_tokens
            for r in (*todo, *waiting)
            if self._rank(r.tenant) == self.floor
        )
        self.decodes_wait = first <= self.budget

    def defer_decode(self, req: Request) -> bool:
        return self.decodes_wait and self.defer_prefill(req)


class FairNoSlotPreemption(FairPolicy):
    """``fair`` that never preempts for a waiting request."""

    def preempt_for_waiting(self, running: Any, waiting: Any) -> tuple[list[Request], ...]:
        return ()


def run(specs: list[RequestSpec], cfg: SimConfig, cost: Any, trace: bool = False) -> Any:
    obs = Observer(specs)
    obs.trace = trace
    undo = obs.install()
    try:
        res = Simulator(cfg, cost).run(specs)
    finally:
        undo()
    return res, obs


def report(label: str, specs: list[RequestSpec], res: Any, obs: Observer) -> None:
    books = obs.books
    light = [i for i, s in enumerate(specs) if s.tenant == "light"]
    ttft = {i: res.timings[i].ttft for i in light if res.timings[i].ttft is not None}
    p99 = float(np.percentile(list(ttft.values()), 99))
    slow = sorted(ttft, key=lambda i: -ttft[i])[: max(3, len(light) // 100)]
    out = sum(t.output_tokens for t in res.timings if t.success)
    print(
        f"\n## {label}: {len(light)} light requests, TTFT p99 {p99:.3f} s; all requests: "
        f"{out / res.duration_s:.1f} output tok/s, {res.stats['num_preemptions']} preemptions, "
        f"recompute tax {100 * res.stats['recompute_tax']:.2f}%"
    )

    def line(name: str, ids: list[int]) -> None:
        tot: collections.Counter[str] = collections.Counter()
        for i in ids:
            tot.update(books[i])
        total = sum(ttft[i] for i in ids)
        cells = " | ".join(f"{100 * tot[c] / total:.0f}%" for c in CAUSES)
        print(f"| {name} | {total / len(ids):.3f} | {cells} |")

    print("| light requests | mean TTFT s | " + " | ".join(CAUSES) + " |")
    print("|---|---|" + "---|" * len(CAUSES))
    line(f"all {len(ttft)}", list(ttft))
    line(f"slowest {len(slow)}", slow)
    for i in slow:
        s, b = specs[i], books[i]
        parts = ", ".join(f"{c} {b[c]:.3f}" for c in CAUSES if b[c] > 0.0005)
        print(f"  #{i}: TTFT {ttft[i]:.3f} s, prompt {s.prompt_len}: {parts}")
        for line_ in obs.steps.get(i, []):
            print(f"      {line_}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("target", choices=("cpu", "h100"))
    p.add_argument("--profile", help="cpu: the CPU profile (benchmarks/scheduling.py's)")
    p.add_argument("--prompts", type=int, default=120, help="cpu: requests in the workload")
    p.add_argument("--rate", type=float, default=6.0, help="cpu: Poisson arrivals, req/s")
    p.add_argument("--time-scale", type=float, default=0.5, help="h100: the trace's time scale")
    p.add_argument("--policies", default="continuous,fair")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trace", action="store_true", help="print the slowest requests' steps, one a line"
    )
    ns = p.parse_args()
    if ns.target == "cpu":
        from iterserve.sim.cpu_profile import CpuProfile, CpuProfileCostModel
        from iterserve.sim.deployment import build_deployment

        if not ns.profile:
            raise SystemExit("cpu needs --profile (iterserve profile ... -o cpu_profile.json)")
        dep = build_deployment(
            model=None, hardware=f"cpu:{ns.profile}", max_model_len=2048, kv_cache_memory="1GiB"
        )
        base = EngineArgs(max_num_seqs=16, max_num_batched_tokens=256).scheduler_config(2048)
        cost: Any = CpuProfileCostModel(CpuProfile.load(ns.profile))
        size = S.SIZES["cpu"]
        specs = S.tenant_specs(
            size, ns.prompts, ns.rate, dep.model.vocab_size, dep.max_model_len, ns.seed
        )
        blocks, block_size = dep.num_kv_blocks, dep.block_size
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from two_tenants import two_tenant_specs

        from iterserve.sim.deployment import build_deployment

        dep = build_deployment(model="llama-3-8b", hardware="h100-sxm")
        base = SchedulerConfig(
            max_num_seqs=64, max_num_batched_tokens=512, max_model_len=dep.max_model_len
        )
        cost = dep.cost
        specs = two_tenant_specs("azure-conv", ns.time_scale, 10.0, ns.seed, dep)
        blocks, block_size = dep.num_kv_blocks, dep.block_size
    light = [s for s in specs if s.tenant == "light"]
    for label, wl, policy in [
        ("light alone", light, "continuous"),
        *((pol, specs, pol) for pol in ns.policies.split(",")),
    ]:
        cfg = SimConfig(
            dataclasses.replace(base, policy=policy), num_kv_blocks=blocks, block_size=block_size
        )
        report(label, wl, *run(wl, cfg, cost, ns.trace))


if __name__ == "__main__":
    main()
