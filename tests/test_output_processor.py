"""The output processor (iterserve/engine/output_processor.py): stop strings, the lag window
after one, n > 1, include_stop_str_in_output, failures; on the byte-level fake tokenizer, so
every expected text is known exactly."""

from __future__ import annotations

import pytest
from server_helpers.fake_engine import EOS, OFFSET, FakeTokenizer

from iterserve.engine.output_processor import CoreOutput, CoreSeqOutput, OutputProcessor
from iterserve.outputs import RequestMetrics
from iterserve.sampling_params import SamplingParams


def ids(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode()]


def core(
    rid: str,
    params: SamplingParams,
    new: list[list[int]],
    finish: list[str | None] | None = None,
    stop_reason: list[int | str | None] | None = None,
    logprobs: bool = False,
) -> CoreOutput:
    finish = finish or [None] * len(new)
    stop_reason = stop_reason or [None] * len(new)
    seqs = [
        CoreSeqOutput(
            i,
            toks,
            [(t, -0.25, 1, [(t, -0.25), (t + 1, -2.0)]) for t in toks] if logprobs else None,
            finish[i],
            stop_reason[i],
        )
        for i, toks in enumerate(new)
    ]
    return CoreOutput(
        rid,
        None,
        ids("prompt: "),
        params,
        seqs,
        all(f is not None for f in finish),
        RequestMetrics(arrival_time=0.0),
    )


def feed(proc: OutputProcessor, rid: str, params: SamplingParams, text: str) -> list:  # type: ignore[type-arg]
    """One token per step, as the engine emits them; returns every step's results."""
    steps = []
    for t in ids(text):
        steps.append(proc.process([core(rid, params, [[t]], logprobs=params.logprobs is not None)]))
    return steps


def test_stop_string_spanning_tokens_cuts_text_tokens_and_logprobs_and_drops_the_lag() -> None:
    proc = OutputProcessor(FakeTokenizer())
    params = SamplingParams(stop=["cde"], logprobs=1, max_tokens=50)
    proc.add_request("r")
    steps = feed(proc, "r", params, "abcdefgh")  # the engine ran past the stop (the lag)
    finishes = [f for _, fs in steps for f in fs]
    assert [(f.request_id, f.index, f.reason, f.stop_reason) for f in finishes] == [
        ("r", 0, "stop", "cde")
    ]
    outs = [o for os_, _ in steps for o in os_]
    assert len(outs) == 5 and outs[-1].finished  # nothing after the final output
    c = outs[-1].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("ab", "stop", "cde")
    assert c.token_ids == ids("abcde")  # tokens up to the one completing the stop string
    assert c.logprobs is not None and len(c.logprobs) == 5
    assert c.logprobs[2][ids("c")[0]].decoded_token == "c"
    assert c.logprobs[2][ids("d")[0]].rank == 2
    # What streamed: "a" once "b" showed no stop could start there, then "b" at the end.
    assert "".join(o.outputs[0].new_text for o in outs) == "ab"
    assert sum(len(o.outputs[0].new_token_ids) for o in outs) == 5
    assert "r" not in proc and len(proc) == 0


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    proc = OutputProcessor(FakeTokenizer())
    params = SamplingParams(stop=["cd"], include_stop_str_in_output=True)
    proc.add_request("r")
    outs = [o for os_, _ in feed(proc, "r", params, "abcdef") for o in os_]
    c = outs[-1].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("abcd", "stop", "cd")
    # Nothing is held back: the stop string is part of the output either way.
    assert [o.outputs[0].new_text for o in outs] == ["a", "b", "c", "d"]


def test_n2_one_sequence_stops_the_other_runs_on() -> None:
    proc = OutputProcessor(FakeTokenizer())
    params = SamplingParams(n=2, stop=["x"])
    proc.add_request("r")
    res, fin = proc.process([core("r", params, [ids("x"), ids("a")])])
    assert [(f.index, f.reason) for f in fin] == [(0, "stop")]
    assert not res[0].finished and res[0].outputs[0].finish_reason == "stop"
    # The engine had not yet freed sequence 0: its next token is dropped.
    res, fin = proc.process([core("r", params, [ids("y"), ids("b")])])
    assert fin == [] and res[0].outputs[0].token_ids == ids("x")
    res, _ = proc.process([core("r", params, [[], ids("c")], finish=["stop", "length"])])
    assert res[0].finished
    assert [(c.text, c.finish_reason) for c in res[0].outputs] == [("", "stop"), ("abc", "length")]


def test_eos_adds_no_text_a_stop_string_wins_over_length_unknown_ids_are_ignored() -> None:
    proc = OutputProcessor(FakeTokenizer())
    p = SamplingParams(stop=["zz"])
    proc.add_request("eos")
    proc.process([core("eos", p, [ids("q")])])
    res, fin = proc.process([core("eos", p, [[EOS]], finish=["stop"], stop_reason=[None])])
    c = res[0].outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, fin) == ("q", [*ids("q"), EOS], "stop", [])
    proc.add_request("len")
    proc.process([core("len", p, [ids("z")])])
    res, fin = proc.process([core("len", p, [ids("z")], finish=["length"])])
    c = res[0].outputs[0]
    # The engine ended it at max_tokens with the same token: no finish to send back.
    assert (c.text, c.finish_reason, c.stop_reason, fin) == ("", "stop", "zz", [])
    assert proc.process([core("never-added", p, [ids("a")])]) == ([], [])


def test_a_failing_decode_fails_that_request_alone() -> None:
    class Broken(FakeTokenizer):
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            if ids("!")[0] in token_ids:
                raise RuntimeError("boom")
            return super().decode(token_ids, skip_special_tokens)

    proc = OutputProcessor(Broken())
    p = SamplingParams(n=2)
    proc.add_request("bad")
    proc.add_request("good")
    res, fin = proc.process(
        [core("bad", p, [ids("!"), ids("a")]), core("good", p, [ids("a"), ids("b")])]
    )
    bad, good = res
    assert bad.finished and bad.error is not None and "boom" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"]
    assert sorted((f.request_id, f.index, f.reason) for f in fin) == [
        ("bad", 0, "error"),
        ("bad", 1, "error"),
    ]
    assert not good.finished and [c.text for c in good.outputs] == ["a", "b"]


def test_sampling_params_include_stop_str_in_output_is_a_bool() -> None:
    assert SamplingParams(include_stop_str_in_output=True).include_stop_str_in_output
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 2])
def test_final_only_gets_one_output_equal_to_the_cumulative_final(n: int) -> None:
    """A final_only request (LLM.generate's) yields nothing until it finishes, then one output
    equal to a cumulative request's final one, with every token as its delta; its prompt
    logprobs, sent once at the first step, reach that output; a stop string still ends it at
    the step that completes it."""
    params = SamplingParams(n=n, stop=["cde"], logprobs=1, max_tokens=50)
    got = {}
    for kind in ("cumulative", "final_only"):
        proc = OutputProcessor(FakeTokenizer())
        proc.add_request("r", kind)  # type: ignore[arg-type]
        steps = []
        for i, t in enumerate(ids("abcdefgh")):
            out = core("r", params, [[t]] * n, logprobs=True)
            if i == 0:
                out.prompt_logprobs = [None, (7, -1.5, 3, [(8, -0.5)])]
            steps.append(proc.process([out]))
        got[kind] = steps
        assert "r" not in proc and len(proc) == 0
    cum = [o for os_, _ in got["cumulative"] for o in os_]
    fin = [o for os_, _ in got["final_only"] for o in os_]
    assert len(cum) == 5 and len(fin) == 1 and fin[0].finished
    # The stop string ("e" is the 5th token) ends both at the same step, with the same finishes.
    assert [fs for _, fs in got["final_only"]] == [fs for _, fs in got["cumulative"]]
    assert [i for i, (os_, _) in enumerate(got["final_only"]) if os_] == [4]
    last, one = cum[-1], fin[0]
    assert one.prompt_logprobs is not None and one.prompt_logprobs == cum[0].prompt_logprobs
    assert one.prompt_logprobs[1] is not None and one.prompt_logprobs[1][7].rank == 3
    for a, b in zip(last.outputs, one.outputs, strict=True):
        assert (b.text, b.token_ids, b.logprobs, b.finish_reason, b.stop_reason) == (
            a.text, a.token_ids, a.logprobs, a.finish_reason, a.stop_reason,
        )  # fmt: skip
        assert (b.text, b.token_ids) == ("ab", ids("abcde"))
        assert b.new_text == b.text and b.new_token_ids == b.token_ids
        assert b.new_logprobs == b.logprobs


def test_finished_lists_send_deltas_and_the_lists_once_a_sequence_finished() -> None:
    """The server's kind: an output every step with the same deltas and text as cumulative
    outputs, but token_ids / logprobs empty until that sequence finished, then whole (n = 2:
    the sequence that stops first keeps its lists in the request's later outputs)."""
    params = SamplingParams(n=2, stop=["x"], logprobs=1, max_tokens=50)
    steps = [
        ([ids("a"), ids("p")], [None, None]),
        ([ids("x"), ids("q")], [None, None]),  # sequence 0 stops on "x"
        ([ids("b"), ids("r")], [None, None]),  # the lag: sequence 0's token is dropped
        ([[], ids("s")], [None, "length"]),
    ]
    outs = {}
    for kind in ("cumulative", "finished_lists"):
        proc = OutputProcessor(FakeTokenizer())
        proc.add_request("r", kind)  # type: ignore[arg-type]
        got = []
        for new, finish in steps:
            out = core("r", params, new, finish=finish, logprobs=True)
            res, _ = proc.process([out])
            got += res
        outs[kind] = got
    cum, fl = outs["cumulative"], outs["finished_lists"]
    assert len(cum) == len(fl) == 4 and fl[-1].finished and not fl[-2].finished
    for a, b in zip(cum, fl, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert (cb.text, cb.new_text, cb.new_token_ids, cb.new_logprobs) == (
                ca.text, ca.new_text, ca.new_token_ids, ca.new_logprobs,
            )  # fmt: skip
            assert cb.finish_reason == ca.finish_reason
            if cb.finish_reason is None:
                assert cb.token_ids == [] and cb.logprobs == []
            else:
                assert (cb.token_ids, cb.logprobs) == (ca.token_ids, ca.logprobs)
    assert [o.outputs[0].token_ids for o in fl] == [[], ids("ax"), ids("ax"), ids("ax")]
    assert fl[-1].outputs[1].token_ids == ids("pqrs")
    with pytest.raises(ValueError, match="output kind must be one of"):
        OutputProcessor(FakeTokenizer()).add_request("r", "delta")  # type: ignore[arg-type]


def test_best_of_ranks_a_candidate_that_ended_in_an_error_last() -> None:
    """best_of ranks by cumulative logprob: a candidate cut short by an error (one token, a
    logprob of -0.1) outranked whole ones (-2 and -3) and was returned; it now comes last."""
    from iterserve.engine.output_processor import _best_of
    from iterserve.outputs import CompletionOutput

    def cand(i: int, lp: float, reason: str) -> CompletionOutput:
        return CompletionOutput(i, f"c{i}", [i], cumulative_logprob=lp, finish_reason=reason)

    comps = [cand(0, -3.0, "length"), cand(1, -0.1, "error"), cand(2, -2.0, "stop")]
    best = _best_of(comps, 2, finished=True)
    assert [(c.index, c.text) for c in best] == [(2, "c2"), (0, "c0")]  # the caller renumbers
    assert _best_of(comps, 3, finished=True)[2].text == "c1"
    assert _best_of(comps, 2, finished=False) == []


def test_best_of_returns_its_sequences_per_sequence_metrics() -> None:
    """best_of 3, n 1: the returned sequence is renumbered 0, and the request metrics' books
    per sequence (cached prompt tokens, preemptions) go with it: read by the new index, the
    server's metrics took candidate 0's (0 cached where the returned one had 16; found by a
    review)."""
    proc = OutputProcessor(FakeTokenizer())
    params = SamplingParams(n=1, best_of=3, max_tokens=2, logprobs=0)
    proc.add_request("r")
    out = core("r", params, [ids("ab"), ids("cd"), ids("ef")], ["length"] * 3)
    for seq, lp in zip(out.seqs, (-3.0, -2.0, -0.5)):  # candidate 2 ranks first
        seq.new_logprobs = [(t, lp / 2, 1, [(t, lp / 2)]) for t in seq.new_token_ids]
    out.metrics.seq_cached_tokens = {0: 0, 1: 16, 2: 12}
    out.metrics.seq_preemptions = {0: 0, 1: 0, 2: 3}
    (final,), _ = proc.process([out])
    assert [(c.index, c.text) for c in final.outputs] == [(0, "ef")]
    assert final.metrics.seq_cached_tokens == {0: 12}
    assert final.metrics.seq_preemptions == {0: 3}
