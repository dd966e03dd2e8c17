"""Structured outputs in the engine: every output parses and validates (the mask forces it,
even on random weights), unconstrained rows are untouched, and matchers stay in step
through preemption."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from iterserve import LLM, SamplingParams
from iterserve.model.builtin import resolve_model
from iterserve.structured import StructuredOutputsParams as SO

# Bounded so that a random model finishes well within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,5}( [A-Z])?"
CHOICES = ["yes", "no", 'it depends "quoted"\n']
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
MAX_TOKENS = 120


def check(spec: SO, text: str) -> None:
    kind = spec.kind
    if kind == "json":
        jsonschema.validate(json.loads(text), spec.json)  # type: ignore[arg-type]
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(spec.regex or "", text), text
    elif kind == "choice":
        assert text in (spec.choice or []), text
    else:
        assert re.fullmatch(r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9]))*\)", text), text


SPECS = {
    "json": SO(json=PERSON),
    "json_object": SO(json_object=True),
    "regex": SO(regex=REGEX),
    "choice": SO(choice=CHOICES),
    "grammar": SO(grammar=EBNF),
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", dtype="float32", seed=0)


@pytest.mark.parametrize("kind", list(SPECS))
def test_random_weights_output_is_valid(llm: LLM, kind: str) -> None:
    spec = SPECS[kind]
    prompts = ["Hello there", "Give me JSON", "1 2 3", "a b c d e f"]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=spec),
        *(
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, structured_outputs=spec)
            for s in range(3)
        ),
    ]
    for out in llm.generate(prompts, params):
        c = out.outputs[0]
        assert out.error is None
        if kind == "json_object" and c.finish_reason == "length":
            # Unbounded strings: a random model may not close one within max_tokens. What
            # it wrote is still a prefix the grammar accepts (the mask held at every step).
            compiled = llm.engine.grammar_compiler.compile(spec)
            assert llm.engine.grammar_compiler.matcher(compiled).accept_string(c.text)
            assert c.text.startswith("{")
            continue
        assert c.finish_reason == "stop", (kind, c.text, c.finish_reason)
        check(spec, c.text)
    llm.engine.check_integrity()


def test_n_sequences_and_ignore_eos_end_when_the_grammar_is_complete(llm: LLM) -> None:
    spec = SPECS["json"]
    p = SamplingParams(
        n=3, max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True,
        structured_outputs=spec,
    )  # fmt: skip
    out = llm.generate("people", p)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.finish_reason == "stop"
        check(spec, c.text)
    assert len({c.text for c in out.outputs}) > 1  # each sequence has its own matcher


def _greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **kw)


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm: LLM) -> None:
    free = ["Hello there", "one two three", "the quick brown fox"]
    alone = [o.outputs[0].token_ids for o in llm.generate(free, _greedy())]
    bounded = [SPECS[k] for k in ("json", "regex", "choice", "grammar")]
    spec_params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=s)
        for s in bounded
    ]
    mixed_prompts = ["x", free[0], "y", free[1], "z", free[2], "w"]
    mixed_params = [
        spec_params[0], _greedy(), spec_params[1], _greedy(), spec_params[2], _greedy(),
        spec_params[3],
    ]  # fmt: skip
    outs = llm.generate(mixed_prompts, mixed_params)
    assert [outs[i].outputs[0].token_ids for i in (1, 3, 5)] == alone
    for i, spec in zip((0, 2, 4, 6), bounded):
        check(spec, outs[i].outputs[0].text)


def test_preemption_and_chunked_prefill_keep_matchers_in_step() -> None:
    """Recompute after a preemption must not feed a matcher the same tokens again: the
    outputs equal those of a roomy pool and still validate."""
    prompts = [" ".join(f"word{i}" for i in range(k, k + 30)) for k in range(8)]
    spec = SPECS["json"]
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, structured_outputs=spec)
        for i in range(len(prompts))
    ]
    roomy = LLM("tiny-random", dtype="float32", seed=0)
    ref = [o.outputs[0].text for o in roomy.generate(prompts, params)]
    tight = LLM(
        "tiny-random", dtype="float32", seed=0, block_size=4, num_kv_blocks=64,
        max_num_batched_tokens=32,
    )  # fmt: skip
    outs = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.outputs[0].text for o in outs] == ref
    for o in outs:
        check(spec, o.outputs[0].text)
    tight.engine.check_integrity()


def test_bad_specs_are_value_errors_naming_the_field(llm: LLM) -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        SO(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        SO(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        SO(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.regex could not be compiled"):
        llm.generate("x", SamplingParams(structured_outputs=SO(regex="([a-")))
    with pytest.raises(ValueError, match="structured_outputs.grammar could not be compiled"):
        llm.generate("x", SamplingParams(structured_outputs=SO(grammar="root ::= nothere")))
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]


def test_a_grammar_still_compiling_does_not_block_other_requests(llm: LLM) -> None:
    """add_request returns at once; the constrained request is scheduled when its grammar
    is ready, a failing one ends with an error output, others run meanwhile."""
    eng = llm.engine
    schema = {**PERSON, "properties": {**PERSON["properties"], "uniq": {"const": "q1"}}}  # type: ignore[dict-item]
    eng.add_request("c", "x", SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                             structured_outputs=SO(json=schema)))  # fmt: skip
    eng.add_request("bad", "x", SamplingParams(structured_outputs=SO(regex="(unclosed")))
    eng.add_request("free", "y", _greedy())
    eng.check_integrity()
    done: dict[str, Any] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        eng.check_integrity()
    assert done["bad"].error and "could not be compiled" in done["bad"].error
    assert done["bad"].outputs[0].finish_reason == "error"
    check(SO(json=schema), done["c"].outputs[0].text)
    assert len(done["free"].outputs[0].token_ids) == 24


def test_abort_while_compiling(llm: LLM) -> None:
    eng = llm.engine
    schema = {**PERSON, "properties": {**PERSON["properties"], "uniq": {"const": "q2"}}}  # type: ignore[dict-item]
    eng.add_request("c2", "x", SamplingParams(structured_outputs=SO(json=schema)))
    eng.abort_request("c2")
    assert not eng.has_unfinished_requests()
    assert eng.step() == []
    eng.check_integrity()


def test_a_cancelled_compile_is_compiled_again_for_the_next_request(llm: LLM) -> None:
    # a client that left cancelled the shared (cached) future: every later request of the
    # same spec then failed with CancelledError, a 500
    import threading

    compiler = llm.engine.grammar_compiler
    gate = threading.Event()
    busy = compiler._pool.submit(gate.wait)  # holds the one compile thread
    spec = SO(regex="[0-9]{3}-cancelled")
    first = compiler.submit(spec)
    assert first.cancel() and first.cancelled()
    again = compiler.submit(spec)
    assert again is not first and not again.cancelled()
    gate.set()
    busy.result(timeout=30)
    assert again.result(timeout=60) is not None
    assert compiler.submit(spec) is again  # cached from then on


@pytest.mark.slow
def test_real_model_json_schema_and_choice() -> None:
    try:
        resolve_model("smollm2-135m")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"smollm2-135m is not available here: {e}")
    llm = LLM("smollm2-135m", seed=0, num_kv_blocks=256)
    tok = llm.tokenizer

    def chat(text: str) -> str:
        msgs = [{"role": "user", "content": text}]
        return str(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))

    # Bounded specs and few tokens: on the shared 2-core machine a decode step of this
    # model takes ~1 s under load.
    cases = [
        (chat("Describe a person called Bob, aged 30, as JSON."), SPECS["json"]),
        (chat("Is the sky blue? Answer yes or no."), SO(choice=["yes", "no"])),
        (chat("Write a product code."), SPECS["regex"]),
    ]
    outs = llm.generate(
        [p for p, _ in cases],
        [SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=s) for _, s in cases],
    )
    for (_, spec), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        check(spec, c.text)


def test_a_grammar_after_a_token_lets_the_model_think_first(llm: LLM) -> None:
    """``structured_outputs_after`` (the server's end of reasoning under --reasoning-parser):
    until that token the reply is the model's own (greedy, as unconstrained), from it on
    the grammar holds. A token the model never samples leaves the reply unconstrained."""
    prompt = [5, 6, 7, 8, 9]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    toks = list(free.outputs[0].token_ids)
    # the end marker: a token at position >= 2 that did not occur before it
    k = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])
    spec = SO(choice=["yes", "no"])
    params = SamplingParams(
        max_tokens=40, temperature=0.0, structured_outputs=spec, structured_outputs_after=toks[k]
    )
    out = llm.generate([prompt], params)[0].outputs[0]
    got = list(out.token_ids)
    assert got[: k + 1] == toks[: k + 1]  # thought freely, up to and with the marker
    rest = llm.tokenizer.decode(got[k + 1 :], skip_special_tokens=True)
    assert rest in ("yes", "no") and out.finish_reason == "stop"
    never = next(t for t in range(3, 1000) if t not in toks)
    params = SamplingParams(
        max_tokens=12, temperature=0.0, structured_outputs=spec, structured_outputs_after=never
    )
    assert list(llm.generate([prompt], params)[0].outputs[0].token_ids) == toks
    with pytest.raises(ValueError, match="structured_outputs_after"):
        SamplingParams(structured_outputs_after=5)
    with pytest.raises(ValueError, match="structured_outputs_after"):
        llm.generate(
            [prompt], SamplingParams(structured_outputs=spec, structured_outputs_after=10**9)
        )


def test_schemas_with_keywords_the_backend_drops_are_refused_saying_where() -> None:
    # xgrammar ignores these (the output could break the schema): refused, not silently loose
    refused = {
        "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "multipleOf": {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}},
        "allOf": {"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]},
        "not": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
        "if / then": {"if": {"type": "string"}, "then": {"maxLength": 3}},
        "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
        "contains": {"type": "array", "contains": {"const": 1}},
        "minLength / maxLength beside pattern": {
            "type": "string",
            "pattern": "^a+$",
            "maxLength": 3,
        },
        "beside format uri": {"type": "string", "format": "uri", "maxLength": 30},
        "dependencies": {"type": "object", "dependencies": {"a": ["b"]}},
        "multipleOf beside minimum": {"type": "integer", "multipleOf": 3, "minimum": 0},
        "required beside $ref": {
            "$defs": {"O": {"type": "object"}},
            "properties": {"o": {"$ref": "#/$defs/O", "required": ["a"]}},
        },
        "maximum beside $ref": {
            "$defs": {"N": {"type": "number"}},
            "properties": {"n": {"$ref": "#/$defs/N", "maximum": 3}},
        },
        # a review's checks broke 5-8 of 8 sampled outputs of each of these
        "properties beside anyOf": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "anyOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}],
        },
        "maximum beside anyOf": {"type": "integer", "maximum": 5, "anyOf": [{"minimum": 3}]},
        "properties beside allOf": {
            "properties": {"a": {"type": "integer"}},
            "allOf": [{"properties": {"b": {"type": "integer"}}}],
        },
        "required 'b' not in properties": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a", "b"],
        },
        "maximum beside enum": {"type": "integer", "enum": [1, 5, 10], "maximum": 4},
        "pattern beside enum": {"type": "string", "enum": ["abc", "x"], "pattern": "^a"},
        "pattern beside const": {"type": "string", "const": "xyz", "pattern": "^a"},
        "enum values outside its type": {"type": "string", "enum": ["a", 1]},
        # characters a JSON string escapes, which xgrammar wrote raw: '{"q": "say "hi""}'
        # a key may repeat there ({"b": 9, "b": 0}), and json.loads counts it once
        "minProperties beside additionalProperties": {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "minProperties": 2,
        },
        "the character '\"' in pattern": {"type": "string", "pattern": '^say "hi"$'},
        "the character '\\\\' in pattern": {"type": "string", "pattern": "^a\\\\b$"},
        "the character '\\n' in pattern": {"type": "string", "pattern": "^a\\nb$"},
        "the character '\\x00' in pattern": {"type": "string", "pattern": "^[\\x00-\\x1f]$"},
        "the character '\\x01' in pattern": {"patternProperties": {"^\\x01$": {}}},
    }
    for what, schema in refused.items():
        with pytest.raises(ValueError, match=re.escape(what)) as e:
            SO(json=schema)
        assert "would not enforce" in str(e.value)
    with pytest.raises(ValueError, match="at /properties/n"):
        SO(json=refused["multipleOf"])
    # an empty anyOf / oneOf / allOf is invalid JSON Schema, which xgrammar compiled as
    # matching nothing: the value stopped where it began, `{"a": }` with a 200
    for key in ("anyOf", "oneOf", "allOf"):
        with pytest.raises(ValueError, match=f"at /properties/a, {key} is empty"):
            SO(json={"type": "object", "properties": {"a": {key: []}}, "required": ["a"]})
    # what it enforces (or what JSON Schema leaves to annotation) passes, and keyword-named
    # properties are names, not keywords
    for schema in (
        {"oneOf": [{"type": "string"}, {"type": "integer"}]},
        # pydantic's Optional field and Literal / Enum, a discriminated union, a mixed enum
        {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "X"},
        {"enum": ["red", "green"], "title": "Color", "type": "string"},
        {"oneOf": [{"type": "string"}], "discriminator": {"propertyName": "kind"}},
        {"enum": ["a", 1, None]},
        {"type": "number", "enum": [1, 2.5]},
        {"type": "string", "format": "password"},
        {"type": "string", "pattern": "^a+$"},
        {"type": "string", "pattern": "^[ -~]+$"},  # a class of several leaves " and \ out
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
        {"type": "string", "pattern": '^[^"]+$'},
        # classes with other characters too: xgrammar leaves the escaped ones out (pydantic's
        # "ASCII only" was refused by a first version of this check)
        {"type": "string", "pattern": "^[\\x00-\\x7F]+$"},
        {"type": "string", "pattern": "^[ \\t]*\\S+$"},
        {"type": "array", "uniqueItems": False},
        {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},
        {"allOf": [{"type": "string"}]},
        # enforced: integer multipleOf, a length beside an unknown format, a uri's implied
        # minLength 1 (pydantic AnyUrl), array keywords on a non-array, a $ref's description
        {"type": "integer", "multipleOf": 5},
        {"type": "string", "format": "binary", "maxLength": 3},
        {"type": "string", "format": "uri", "minLength": 1},
        {"type": "string", "uniqueItems": True},
        {
            "$defs": {"A": {"type": "string"}},
            "properties": {"a": {"$ref": "#/$defs/A", "description": "an a"}},
        },
    ):
        SO(json=schema)
    deep = '{"items":' * 600 + "{}" + "}" * 600
    with pytest.raises(ValueError, match="nests deeper than 64"):
        SO(json=deep)
    with pytest.raises(ValueError, match="nests deeper than 64"):
        SO(json=json.loads('{"items":' * 80 + "{}" + "}" * 80))


def test_disable_any_whitespace_picks_the_json_whitespace(llm: LLM) -> None:
    gc = llm.engine.grammar_compiler
    schema = {"type": "object", "properties": {"d": {"type": "integer"}}, "required": ["d"]}
    spaced = ('{"d": 1}', '{"d":1}', '{\n  "d" : 1\n}')
    # absent: json.dumps' separators; true: none at all (vLLM's flag); false: any (vLLM's
    # default); json_object alike, each its own grammar
    for flag, accepted in ((None, [True, False, False]), (True, [False, True, False]),
                           (False, [True, True, True])):  # fmt: skip
        for spec in (SO(json=schema, disable_any_whitespace=flag),
                     SO(json_object=True, disable_any_whitespace=flag)):  # fmt: skip
            compiled = gc.compile(spec)
            assert [gc.matcher(compiled).accept_string(s) for s in spaced] == accepted, spec
            assert not gc.matcher(compiled).accept_string('{"d": x}')
    # a regex states its own whitespace: the flag does not make another grammar
    assert SO(regex="a b", disable_any_whitespace=False).key == SO(regex="a b").key
    with pytest.raises(ValueError, match="disable_any_whitespace must be true, false or absent"):
        SO(json=schema, disable_any_whitespace="no")  # type: ignore[arg-type]
    # a second kind counts whatever its value, as in vLLM (it was dropped when false)
    for extra in ({"regex": ""}, {"json_object": False}, {"choice": []}):
        with pytest.raises(ValueError, match="exactly one of"):
            SO(json=schema, **extra)
    with pytest.raises(ValueError, match="json_object must be true or absent"):
        SO(json_object=False)


def test_pattern_lookarounds_are_rewritten_or_refused(llm: LLM) -> None:
    # xgrammar ignores a pattern's lookahead: pydantic's Decimal pattern runs as the same
    # strings written without one, any other lookaround is refused where it is
    decimal = r"^(?!^[-+.]*$)[+-]?0*\d*\.?\d*$"
    schema = {"type": "object", "properties": {"d": {"type": "string", "pattern": decimal}}}
    spec = SO(json=schema)
    assert schema["properties"]["d"]["pattern"] == decimal  # the request's own is untouched
    gc = llm.engine.grammar_compiler
    compiled = gc.compile(spec)
    for d in ("1", "-0.5", "+.5", "007.", "12.34"):
        assert gc.matcher(compiled).accept_string(f'{{"d": "{d}"}}'), d
    for d in ("", "-", ".", "+.", "1e5", "1.2.3"):  # the lookahead's (and the rest's) refusals
        assert not gc.matcher(compiled).accept_string(f'{{"d": "{d}"}}'), d
    # pydantic's dict[Decimal, int] names its keys by the same pattern
    keyed = {"type": "object", "patternProperties": {decimal: {"type": "integer"}}}
    compiled = gc.compile(SO(json=keyed))
    assert gc.matcher(compiled).accept_string('{"1.5": 1}')
    assert not gc.matcher(compiled).accept_string('{"-": 1}')
    condecimal = r"^(?!^[-+.]*$)[+-]?0*(?:\d{0,3}|(?=[\d.]{1,6}0*$)\d{0,3}\.\d{0,2}0*$)"
    refused = {
        "/properties/d": {"properties": {"d": {"type": "string", "pattern": condecimal}}},
        "/": {"type": "string", "pattern": "^a(?<=a)b$"},
        "/items": {"items": {"type": "object", "patternProperties": {"^(?=x)": {}}}},
    }
    for where, bad in refused.items():
        with pytest.raises(ValueError, match=f"at {re.escape(where)},.*lookaround"):
            SO(json=bad)
    # not lookarounds: escaped, inside a class, a named group, a non-capturing group
    for ok in (r"^\(?=$", r"^[(?=]+$", r"^(?P<a>x)$", r"^(?:ab)+$", r"^[]?!]+$"):
        SO(json={"type": "string", "pattern": ok})


def test_a_lark_grammar_is_read_as_lark_as_vllm_reads_it(llm: LLM) -> None:
    # no "name ::= ..." rule outside comments: Lark's syntax (it was an EBNF lexer error)
    for g in ('start: "yes" | "no"', '// not a rule ::= x\nstart: answer\nanswer: "yes" | "no"'):
        out = llm.generate("x", SamplingParams(max_tokens=8, structured_outputs=SO(grammar=g)))
        assert out[0].outputs[0].text in ("yes", "no"), g
    # "::=" inside a Lark string is not an EBNF rule (it was read as EBNF and failed)
    g = 'start: "a::=b" | "no"'
    out = llm.generate("x", SamplingParams(max_tokens=8, structured_outputs=SO(grammar=g)))
    assert out[0].outputs[0].text in ("a::=b", "no")
    with pytest.raises(ValueError, match="(?s)could not be compiled: Lark.*read as Lark"):
        llm.generate("x", SamplingParams(structured_outputs=SO(grammar="start: undefined_rule")))
    with pytest.raises(ValueError, match="grammar must be a non-empty string"):
        SO(grammar="  \n ")
    SO(regex=" ")  # a regex of one space matches one space


def test_a_special_tokens_text_in_a_choice_is_spelled_not_the_token_emitted(llm: LLM) -> None:
    """xgrammar matched special tokens as their text: for the choice ["<|eos|>", "x"] the model
    could emit the EOS token itself, whose text the detokenizer drops, so the answer was ''
    (none of the choices) with finish 'stop' (found by a review). Now the text is spelled
    out in ordinary tokens, and a stop token still ends the grammar."""
    tok = llm.engine.tokenizer
    special = set(tok.all_special_ids)
    for choice in (["<|eos|>", "x"], ["<|im_start|>", "y"]):
        for seed in range(4):
            p = SamplingParams(
                max_tokens=30,
                temperature=1.0,
                seed=seed,
                logit_bias={2: 30.0, 1: 30.0, 3: 30.0},  # pull toward the special tokens
                structured_outputs=SO(choice=choice),
            )
            out = llm.generate(["Pick one"], p)[0].outputs[0]
            assert out.finish_reason == "stop" and out.text in choice, (choice, out)
            body = (
                out.token_ids[:-1]
                if out.token_ids[-1] in llm.engine.eos_token_ids
                else out.token_ids
            )
            assert not special & set(body), out.token_ids


def test_a_fill_that_waits_without_computing_is_not_too_slow(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mask-fill limit counts the engine thread's CPU time: timed by the wall clock, a
    0.03 ms fill that waited for the GIL (another thread's long json.loads) or for a core
    failed 13 of 24 trivial requests as "too ambiguous" (found by a review). A fill that
    sleeps 60 ms (past the 50 ms limit) without computing must pass; one that computes as
    long must not."""
    import time

    real = llm.engine.grammar_compiler.matcher

    class Slow:
        def __init__(self, m: Any, busy: bool) -> None:
            self.m, self.busy = m, busy

        def __getattr__(self, name: str) -> Any:
            return getattr(self.m, name)

        def fill_next_token_bitmask(self, *args: Any) -> Any:
            if self.busy:  # 60 ms of this thread's CPU time, however long that takes
                t0 = time.thread_time()
                while time.thread_time() - t0 < 0.06:
                    pass
            else:
                time.sleep(0.06)
            return self.m.fill_next_token_bitmask(*args)

    spec = SO(choice=["yes", "no"])
    sp = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=spec)
    for busy, fails in ((False, False), (True, True)):
        monkeypatch.setattr(
            llm.engine.grammar_compiler, "matcher", lambda c, b=busy: Slow(real(c), b)
        )
        (out,) = llm.generate(["x"], sp)
        assert (out.error is not None and "too ambiguous" in out.error) == fails, out.error
        if not fails:
            assert out.outputs[0].text in ("yes", "no")


def test_the_compile_cache_keeps_property_order_and_sizes_count_characters() -> None:
    """The cache key sorted a schema's keys, but xgrammar writes properties in their order:
    whichever of {a, b} and {b, a} compiled first set the other's output order (found by a
    review). And a size limit counted each non-ASCII character as its 6-character \\uXXXX
    escape (a choice of 11,000 CJK characters read as 66,010)."""
    from iterserve.structured.params import grammar_size

    props = {"a": {"type": "integer"}, "b": {"type": "integer"}}
    ab = SO(json={"type": "object", "properties": props, "required": ["a", "b"]})
    ba = SO(json={"type": "object", "properties": dict(reversed(props.items())),
                  "required": ["a", "b"]})  # fmt: skip
    assert ab.key != ba.key
    assert grammar_size(SO(choice=["日" * 11_000, "no"])) < 11_100
    assert grammar_size(SO(json={"type": "string", "enum": ["é" * 100]})) < 150


def test_json_strings_take_no_utf16_surrogate_bytes(llm: LLM) -> None:
    """xgrammar's JSON string characters took ED A0-BF xx, the UTF-8-like bytes of a UTF-16
    surrogate, which no text has: the detokenizer wrote U+FFFD for them, past maxLength
    (`{"s": "���ثP"}` for maxLength 3) and the schema (found by a review). Valid UTF-8 of
    either side of the range still passes."""
    gc = llm.engine.grammar_compiler
    # the byte-level tokenizer's token of each single byte (GPT-2's byte-to-character map)
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    vocab = llm.tokenizer.get_vocab()

    def takes(spec: SO, seq: list[int]) -> bool:
        m = gc.matcher(gc.compile(spec))
        return all(m.accept_token(vocab[char[b]]) for b in seq)

    quoted = {"surrogate": [0xED, 0xA0, 0x80], "U+D7FF": [0xED, 0x9F, 0xBF]}
    quoted |= {"U+E000": [0xEE, 0x80, 0x80], "é": [0xC3, 0xA9]}
    for spec, pre, post in (
        (SO(json={"type": "string"}), [0x22], [0x22]),
        (SO(json={"type": "string", "maxLength": 3}), [0x22], [0x22]),
        (SO(json_object=True), list(b'{"a": "'), list(b'"}')),
    ):
        got = {k: takes(spec, pre + v + post) for k, v in quoted.items()}
        assert got == {"surrogate": False, "U+D7FF": True, "U+E000": True, "é": True}, spec
