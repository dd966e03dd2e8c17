"""Hugging Face Hub ids (``org/name``) as local checkpoint folders, through
``huggingface_hub.snapshot_download`` into the usual HF cache.

The environment is read at call time (``HF_HUB_OFFLINE``, ``HF_TOKEN``, ``HF_HOME`` /
``HF_HUB_CACHE``, ``HF_ENDPOINT``), not when huggingface_hub was imported. Offline, or when the
Hub does not answer within ``HUB_TIMEOUT_S``, a cached snapshot is used if there is one, and
otherwise the error says how to pass a local folder instead: never a long retry loop.
"""

from __future__ import annotations

import os
import re

HUB_TIMEOUT_S = 5.0
# What a checkpoint folder needs (config, weights, tokenizer, chat template); not other formats.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def looks_like_repo_id(name: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(_REPO_ID.fullmatch(name)) and not os.path.exists(name) and ".." not in name


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_cache() -> str | None:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None  # huggingface_hub's default (~/.cache/huggingface/hub)


def download(repo_id: str) -> str:
    """The local snapshot folder of model ``repo_id``, downloaded (or updated) when online."""
    from httpx2 import TransportError
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    token = os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's saved login, if any
    endpoint = os.environ.get("HF_ENDPOINT") or None
    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    why_local, fix = "HF_HUB_OFFLINE is set", "download it while online (unset HF_HUB_OFFLINE)"
    revision: str | None = None
    if not offline:
        # One bounded request first: snapshot_download's own look-up has no timeout, so an
        # unreachable Hub could hang it.
        try:
            info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, timeout=HUB_TIMEOUT_S)
            revision = info.sha
        except (RepositoryNotFoundError, GatedRepoError) as e:
            raise ValueError(
                f"Hugging Face Hub model {repo_id!r} was not found or needs access: check the id, "
                "and for a private or gated model set HF_TOKEN to a token that can read it"
            ) from e
        except (HfHubHTTPError, OfflineModeIsEnabled, TransportError) as e:
            why_local = f"the Hub did not answer ({type(e).__name__}: {e})"
            fix = "check the network (and HF_ENDPOINT) and retry"
    try:
        return str(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=_hub_cache(),
                token=token,
                endpoint=endpoint,
                local_files_only=revision is None,
                allow_patterns=ALLOW_PATTERNS,
                etag_timeout=HUB_TIMEOUT_S,
            )
        )
    except LocalEntryNotFoundError as e:
        where = _hub_cache() or constants.HF_HUB_CACHE
        raise FileNotFoundError(
            f"model {repo_id!r} is not in the Hugging Face cache ({where}) and {why_local}; "
            f"{fix}, or pass a local folder: "
            "--model /path/to/checkpoint (config.json + *.safetensors + tokenizer) or a .gguf file"
        ) from e
