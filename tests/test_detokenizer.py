"""The incremental detokenizer's decode: a Hugging Face fast tokenizer's Rust backend directly,
only where that is exactly what ``tokenizer.decode`` would return."""

from __future__ import annotations

import random
from typing import Any

from transformers import AutoTokenizer

from iterserve.engine.detokenizer import IncrementalDetokenizer, _decoder
from iterserve.model.builtin import resolve_model


def test_the_backend_decode_gives_the_wrappers_text() -> None:
    tok: Any = AutoTokenizer.from_pretrained(resolve_model("tiny-random"))
    rng = random.Random(0)
    for skip in (True, False):
        fn = _decoder(tok, skip)
        assert "rust_decode" in fn.__code__.co_freevars  # the fast path was taken
        for _ in range(500):  # special tokens (ids 0..4) included
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))]
            assert fn(ids) == tok.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_or_wraps_decode_keeps_its_own_decode() -> None:
    tok: Any = AutoTokenizer.from_pretrained(resolve_model("tiny-random"))
    calls: list[list[int]] = []

    class Wrapped:  # not a transformers tokenizer: its decode is what must run
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            calls.append(ids)
            return str(tok.decode(ids, skip_special_tokens=skip_special_tokens))

        def __getattr__(self, name: str) -> Any:
            return getattr(tok, name)

    d = IncrementalDetokenizer(Wrapped(), [1, 2, 3])  # type: ignore[arg-type]
    d.add_token(100)
    assert calls
    tok.clean_up_tokenization_spaces = True
    assert "rust_decode" not in _decoder(tok, True).__code__.co_freevars


class CharTokenizer:
    """Token i decodes to the i-th character of ALPHABET: text in tokens, one a char."""

    ALPHABET = "ab.c\n"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.ALPHABET[i] for i in ids)


def _run(text: str, stop: list[str], min_tokens: int, include: bool = False) -> tuple[str, int]:
    d = IncrementalDetokenizer(
        CharTokenizer(),  # type: ignore[arg-type]
        [0],
        stop=stop,
        include_stop_str_in_output=include,
        min_tokens=min_tokens,
    )
    for n, ch in enumerate(text, 1):
        if d.add_token(CharTokenizer.ALPHABET.index(ch)) is not None:
            return d.text, n
    return d.text, len(text)


def test_stop_strings_wait_for_min_tokens() -> None:
    """vLLM's rule: a stop string counts only when it ends in the text of token
    min_tokens + 1 or later (it may start earlier)."""
    assert _run("a.b.c.", ["."], 0) == ("a", 2)
    assert _run("a.b.c.", ["."], 2) == ("a.b", 4)  # the "." of token 2 is inside min_tokens
    assert _run("a.b.c.", ["."], 4) == ("a.b.c", 6)
    assert _run("a.b.c.", ["."], 6) == ("a.b.c.", 6)  # never a stop
    assert _run("ab.c", ["b.c"], 3) == ("a", 4)  # starts inside, ends after: a stop
    assert _run("ab.c", ["b."], 3) == ("ab.c", 4)  # ends inside: not one
    assert _run("a.b.", ["."], 2, include=True) == ("a.b.", 4)


def test_tokens_that_decode_to_nothing_keep_the_window_short() -> None:
    """Skipped special tokens (EOS repeated under ignore_eos) add no text; the window moves
    on past them as past any token, so each costs the same, and the text stays the full
    decode's."""
    tok: Any = AutoTokenizer.from_pretrained(resolve_model("tiny-random"))
    rng = random.Random(1)
    ids = [rng.choice([2] * 3 + list(range(100, 2000))) for _ in range(3000)]
    ids[500:2500] = [2] * 2000  # a long run of EOS
    d = IncrementalDetokenizer(tok, [1, 5, 6])
    longest = 0
    for t in ids:
        d.add_token(t)
        longest = max(longest, len(d._ids))
    assert d.text == tok.decode(ids, skip_special_tokens=True)
    assert longest < 100, longest
