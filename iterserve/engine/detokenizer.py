"""Incremental detokenization with stop strings.

Decoding one token alone breaks multi-byte characters and word-boundary spaces, so each
step decodes a short window (a few tokens of context before the unread ones) and keeps the
part past the context. Text that could still turn out to be the start of a stop string is
held back from streaming until it is known not to be (unless the stop string is to be kept in
the output anyway: ``include_stop_str_in_output``, as in vLLM).

The one implementation of both, used by iterserve/engine/output_processor.py for the offline
engine and the server alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as RustTokenizer
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from iterserve.engine.protocol import Tokenizer

_CONTEXT = 5  # tokens of left context; enough for byte-level BPE and SentencePiece spaces


def _decoder(tokenizer: Tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` with these options, or, for a Hugging Face fast tokenizer whose
    decoding transformers does not change (its own ``decode`` / ``_decode``, no clean-up), its
    Rust backend's ``decode`` directly: the same text, since that is all the wrapper calls then,
    without the wrapper's Python around it (a generated token takes two calls)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerBase)
        and isinstance(backend, RustTokenizer)
        and cls.decode is PreTrainedTokenizerBase.decode
        and getattr(getattr(cls, "_decode", None), "__module__", None)
        == "transformers.tokenization_utils_tokenizers"
        and getattr(tokenizer, "clean_up_tokenization_spaces", None) is False
    ):
        rust_decode = backend.decode
        return lambda ids: rust_decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        # vLLM's rule: stop strings count only from the text of token min_tokens + 1 on
        self.min_tokens = min_tokens
        self._count = 0  # generated tokens added
        self.skip_special_tokens = skip_special_tokens
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        # Text that may start a stop string waits, unless that string is kept anyway.
        self._holdback = 0 if self.include_stop else max((len(s) for s in self.stop), default=1) - 1
        self._ids = list(prompt_token_ids[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""
        self._emitted = 0

    def add_token(self, token_id: int) -> str | None:
        """Adds one generated token; returns the stop string if the text now contains one
        (the text is then cut just before it, or just after it with
        ``include_stop_str_in_output``). Before ``min_tokens`` tokens no stop string ends
        the text; after, only one that ends in a later token's text."""
        self._ids.append(token_id)
        self._count += 1
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if full_text == prefix_text and not self._decode([token_id]):
            # A token that adds nothing here or alone (a skipped special token: EOS under
            # ignore_eos) leaves the window, as decode leaves it out: kept, a run of them
            # re-decoded an ever longer window; moved past, a SentencePiece decoder would
            # strip the next word's leading space at the window's start.
            self._ids.pop()
            return None
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None  # an incomplete character: wait for more bytes
        old_len = len(self.text)
        self.text += full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        if len(self._ids) > 4 * _CONTEXT:  # keep the window short
            drop = self._prefix - _CONTEXT if self._prefix > _CONTEXT else 0
            if drop > 0:
                del self._ids[:drop]
                self._prefix -= drop
                self._read -= drop
        if self._count <= self.min_tokens:
            return None
        for s in self.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0:
                self.text = self.text[: idx + len(s) if self.include_stop else idx]
                return s
        return None

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out, minus what might still become a stop string."""
        end = (
            len(self.text)
            if finished or not self._holdback
            else max(self._emitted, len(self.text) - self._holdback)
        )
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
