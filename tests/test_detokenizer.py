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


def _llama_style_tokenizer() -> Any:
    """A small BPE with byte fallback and the decoder transformers writes for Llama-2 /
    Mistral (its Strip removes one leading space of what it decodes), trained offline."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    text = ["Hello world, this is a test of the tokenizer.", "too much to do, the thing"] * 20
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(text, trainer)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def test_a_skipped_special_token_keeps_the_next_words_space() -> None:
    """After EOS (skipped) the next "▁word" keeps its space: the special token leaves the
    window rather than moving it, where a Llama-style decoder strips a leading space."""
    tok = _llama_style_tokenizer()
    words = tok.encode("He too much thing", add_special_tokens=False)
    eos = tok.eos_token_id
    rng = random.Random(3)
    for _ in range(200):
        out = [rng.choice([eos, *words]) for _ in range(rng.randint(1, 12))]
        prompt = tok.encode("Hello world", add_special_tokens=True)
        d = IncrementalDetokenizer(tok, prompt)
        for t in out:
            d.add_token(t)
        want = tok.decode(prompt + out, skip_special_tokens=True)
        assert d.text == want[len(tok.decode(prompt, skip_special_tokens=True)) :], out
