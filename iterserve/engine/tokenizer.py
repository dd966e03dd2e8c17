"""Tokenizer loading: the checkpoint folder's own tokenizer files via transformers."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from iterserve.engine.protocol import Tokenizer


def load_tokenizer(path: str) -> Tokenizer:
    """Loads the fast tokenizer (and chat template) saved in ``path``."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        raise FileNotFoundError(
            f"no tokenizer files in {path!r}: expected one of {', '.join(names)} next to "
            "config.json"
        )
    # transformers types convert_ids_to_tokens as str | list[str] (an int gives a str); the
    # engine and the server only ever pass lists.
    return cast("Tokenizer", AutoTokenizer.from_pretrained(path))
