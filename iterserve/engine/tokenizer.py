"""Tokenizer loading: the checkpoint folder's own tokenizer files via transformers."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path: str) -> Any:
    """Loads the fast tokenizer (and chat template) saved in ``path``."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        raise FileNotFoundError(
            f"no tokenizer files in {path!r}: expected one of {', '.join(names)} next to config.json"
        )
    return AutoTokenizer.from_pretrained(path)
