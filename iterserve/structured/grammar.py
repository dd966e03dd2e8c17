"""Guided decoding on xgrammar: a spec is compiled once (cached by its canonical text) into a
grammar; each sequence gets its own matcher, which fills its row of the step's token bitmask
and advances on every accepted token.

Why xgrammar (docs/STRUCTURED.md has the measurements): its CPU mask kernel and
per-token fill cost microseconds on this vocabulary, its compile of a JSON schema tens of
milliseconds; llguidance compiled faster but its torch mask path was far slower on CPU.

Threading: ``compile``/``submit`` may be called from any thread; compilation runs on ONE
worker thread of its own (never the engine thread, so a 30 ms schema compile does not stall
a step). Matchers are used by the engine thread only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import json
import re
import threading
from typing import TYPE_CHECKING, Any

import torch

from iterserve.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

_XGR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")
CACHE_SIZE = 256  # compiled grammars kept (LRU); a compiled JSON schema is ~100s of KiB


def _ebnf_string(s: str) -> str:
    # An EBNF string literal; json.dumps' escapes (\" \\ \n \uXXXX) are EBNF's too.
    return json.dumps(s, ensure_ascii=False)


# xgrammar 0.2.9 writes a string with maxLength/minLength as this character class, which
# lets raw control characters (U+0000-U+001F) in: invalid JSON that json.loads refuses.
_LENIENT_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\uD800-\uDFFF]"
# Its plain strings' character class, which takes the bytes of a UTF-16 surrogate (ED A0-BF
# xx, not UTF-8): the detokenizer writes them as U+FFFD, past maxLength and any pattern;
# the surrogates are left out.
_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
_STRING_CHAR_UTF8 = r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"


def _json_schema_ebnf(schema: object, whitespace: str) -> str:
    """The EBNF of a JSON schema: its whitespace by ``whitespace`` (``params.WHITESPACE``:
    json.dumps' separators, none, or any; free whitespace only when asked for, since a small
    model could emit it until max_tokens), strict (no extra properties unless the schema
    allows them), and strings that exclude raw control characters."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(
        json.dumps(schema),
        any_whitespace=whitespace == "any",
        separators=(",", ":") if whitespace == "none" else None,
        strict_mode=True,
    )
    ebnf = str(grammar).replace(_LENIENT_STRING_CHAR, _JSON_STRING_CHAR)
    return ebnf.replace(_STRING_CHAR, _STRING_CHAR_UTF8)


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer and model vocabulary.

    ``stop_token_ids``: the tokens that end a sequence (the model's EOS); a matcher allows
    them once the grammar is complete, and is terminated after accepting one.
    """

    def __init__(
        self, tokenizer: object, vocab_size: int, stop_token_ids: list[int] | frozenset[int]
    ) -> None:
        # The worker builds the tokenizer info from a copy: HF fast tokenizers must not be
        # used by two threads at once, and the engine thread keeps using its own.
        self._tokenizer = copy.deepcopy(tokenizer)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="iterserve-grammar"
        )
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[
            tuple[str, str, str], concurrent.futures.Future[xgr.CompiledGrammar]
        ] = collections.OrderedDict()

    def submit(
        self, spec: StructuredOutputsParams
    ) -> concurrent.futures.Future[xgr.CompiledGrammar]:
        """The compiled grammar of ``spec``, as a future (already done on a cache hit).
        A spec that does not compile ends in ValueError naming the field."""
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None and not fut.cancelled():  # a cancelled one is compiled again
                self._cache.move_to_end(spec.key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Blocks until ``spec`` is compiled (on the worker); raises ValueError if it cannot."""
        return self.submit(spec).result()

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer,  # type: ignore[arg-type]
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids or None,
            )
            info = _without_special_text(xgr, info, self._tokenizer, self.vocab_size)
            # One compile thread: the machine's cores belong to the model's forward.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        c = self._xgr_compiler()
        kind, _, whitespace = spec.key
        lark = kind == "grammar" and spec.grammar is not None and _is_lark(spec.grammar)
        try:
            if kind in ("json", "json_object"):
                schema = spec.json if kind == "json" else {"type": "object"}
                return c.compile_grammar(_json_schema_ebnf(schema, whitespace))
            if kind == "regex":
                assert spec.regex is not None
                return c.compile_regex(spec.regex)
            if kind == "choice":
                assert spec.choice is not None
                return c.compile_grammar(
                    "root ::= " + " | ".join(_ebnf_string(s) for s in spec.choice)
                )
            assert spec.grammar is not None
            if lark:
                import xgrammar as xgr

                return c.compile_grammar(xgr.Grammar.from_lark(spec.grammar))
            return c.compile_grammar(spec.grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad specs
            # xgrammar's messages start with "[time] /project/cpp/file.cc:line: ".
            msg = _XGR_PREFIX.sub("", str(e).strip()) or type(e).__name__
            if lark:
                msg += " (read as Lark: it has no EBNF rule, name ::= ...)"
            raise ValueError(f"structured_outputs.{kind} could not be compiled: {msg}") from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w.-]*\s*::=")


def _without_special_text(xgr: Any, info: Any, tokenizer: Any, vocab_size: int) -> Any:
    """``info`` with the special tokens' text made unmatchable (an empty string, which
    xgrammar takes as a special token; the stop tokens still end a grammar). Read as their
    text, a choice ["<|eos|>", "x"] let the model emit the EOS token itself, whose text the
    detokenizer then drops: an empty answer that is none of the choices."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special |= {int(i) for i, tok in decoder.items() if getattr(tok, "special", False)}
    special = {i for i in special if 0 <= i < vocab_size}
    if not special:
        return info
    encoded = [""] * vocab_size
    for text, i in tokenizer.get_vocab().items():
        if 0 <= i < vocab_size and i not in special:
            encoded[i] = text
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded, info.dump_metadata())


def _is_lark(grammar: str) -> bool:
    """A grammar with no line that opens an EBNF rule (``name ::= ...``) outside comments is
    read as Lark's syntax (``name: ...``), as vLLM reads it (vLLM looks for ``::=`` anywhere,
    so a Lark string holding one was read as EBNF)."""
    lines = (re.sub(r"(#|//).*$", "", line) for line in grammar.split("\n"))
    return not any(_EBNF_RULE.match(line) for line in lines)


class TokenBitmask:
    """The step's bitmask: one int32 row of ceil(vocab / 32) words per sampled sequence,
    filled only for constrained rows (the sampler reads only those rows)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._buf = torch.empty(0, (vocab_size + 31) // 32, dtype=torch.int32)

    def rows(self, n: int) -> torch.Tensor:
        if self._buf.shape[0] < n:
            self._buf = torch.empty(
                max(n, 2 * self._buf.shape[0]), self._buf.shape[1], dtype=torch.int32
            )
        return self._buf[:n]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets ``logits[i, t] = -inf`` for every token t that ``bitmask[i]`` forbids, for the
    rows ``rows`` only (xgrammar's CPU kernel; the other rows are not touched)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
