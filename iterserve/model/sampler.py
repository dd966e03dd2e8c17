"""Vectorised sampling: allowed_token_ids, bad_words, logit_bias, penalties, min_tokens,
greedy, temperature / top-k / top-p / min-p, per-request seeds and logprobs, for one row of
logits per sequence.

Greedy rows without penalties or logprobs (the common benchmark case) cost one argmax.
Seeded rows draw their noise from their own ``torch.Generator`` so a seed gives the same
tokens whatever else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from iterserve.core.request import Request
from iterserve.model import kernels
from iterserve.sampling_params import SamplingParams

# (token_id, logprob, rank) of the sampled token, then the top-n as (token_id, logprob).
TokenLogprobs = tuple[int, float, int, list[tuple[int, float]]]


class TokenLists:
    """A request's token lists in the form the sampler applies them on every step, built once
    per request (the engine's ``add_request``; its n sequences share it), so that a step's cost
    does not grow with the lists in Python: bad words split into the one-token ones (always
    banned) and the rest, indexed by the last token of their head and then by the head itself;
    the token ids of allowed_token_ids, logit_bias and the min_tokens stop tokens as tensors,
    made once per vocabulary size and device. Tokens past the logits' vocabulary are skipped.

    ``bad_words_token_ids``: ``params.bad_words`` as token sequences (the engine tokenizes
    them)."""

    __slots__ = ("params", "always_banned", "banned_after", "_tensors")

    def __init__(
        self, params: SamplingParams, bad_words_token_ids: Iterable[Sequence[int]] = ()
    ) -> None:
        self.params = params
        always: set[int] = set()
        # the head's last token -> the head's length -> the head -> the words' last tokens
        after: dict[int, dict[int, dict[tuple[int, ...], list[int]]]] = {}
        for word in bad_words_token_ids:
            if not word:
                continue
            *head, last = word
            if not head:
                always.add(last)
            else:
                by_len = after.setdefault(head[-1], {})
                by_len.setdefault(len(head), {}).setdefault(tuple(head), []).append(last)
        self.always_banned = sorted(always)
        self.banned_after = after
        self._tensors: dict[tuple[object, ...], torch.Tensor] = {}

    @property
    def has_bad_words(self) -> bool:
        return bool(self.always_banned or self.banned_after)

    def _cached(self, key: tuple[object, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``'s tensor, made on the first call for ``key`` only."""
        t = self._tensors.get(key)
        if t is None:
            t = self._tensors[key] = make()
        return t

    def _ids(
        self,
        key: tuple[object, ...],
        ids: Callable[[], Iterable[int]],
        vocab: int,
        dev: torch.device,
    ) -> torch.Tensor:
        """The tensor of ``ids()`` below ``vocab`` on ``dev``."""
        return self._cached(
            (*key, vocab, dev),
            lambda: torch.tensor([i for i in ids() if i < vocab], dtype=torch.long, device=dev),
        )

    def always_banned_ids(self, vocab: int, dev: torch.device) -> torch.Tensor:
        """The one-token bad words."""
        return self._ids(("bad",), lambda: self.always_banned, vocab, dev)

    def banned_after_output(self, req: Request) -> list[int]:
        """The last tokens of the longer bad words whose head the output ends with: one dict
        lookup, and one per head length among the words whose head ends as the output does."""
        toks = req.all_token_ids
        n_out = len(toks) - len(req.prompt_token_ids)
        by_len = self.banned_after.get(toks[-1]) if n_out else None
        if by_len is None:
            return []
        out: list[int] = []
        for n, heads in by_len.items():
            if n_out >= n:
                out += heads.get(tuple(toks[-n:]), ())
        return out

    def allowed_ids(self, vocab: int, dev: torch.device) -> torch.Tensor:
        return self._ids(("allowed",), lambda: self.params.allowed_token_ids or (), vocab, dev)

    def stop_ids(self, vocab: int, dev: torch.device, eos: frozenset[int]) -> torch.Tensor:
        """EOS and stop_token_ids (what min_tokens holds back)."""
        stops = self.params.stop_token_ids or ()
        return self._ids(("stop", eos), lambda: sorted(eos.union(stops)), vocab, dev)

    def bias(
        self, vocab: int, dev: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias's token ids and their values (in ``dtype``)."""
        bias = self.params.logit_bias or {}
        vals = self._cached(
            ("bias values", dtype, vocab, dev),
            lambda: torch.tensor(
                [v for t, v in bias.items() if t < vocab], dtype=dtype, device=dev
            ),
        )
        return self._ids(("bias",), lambda: bias, vocab, dev), vals


@dataclass
class SampleRow:
    """What the sampler needs to know about one sequence. Token lists are read only when
    penalties or min_tokens ask for them (no per-step copies on the common path)."""

    params: SamplingParams
    generator: torch.Generator | None
    request: Request
    # the request's bad words and token-id lists, precomputed (see TokenLists); None: built
    # from params on each step, without bad words
    token_lists: TokenLists | None = None

    @property
    def lists(self) -> TokenLists:
        return self.token_lists if self.token_lists is not None else TokenLists(self.params)

    @property
    def has_bad_words(self) -> bool:
        return self.token_lists is not None and self.token_lists.has_bad_words

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.request.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.request.eos_token_ids


def _flat_index(parts: Sequence[tuple[int, torch.Tensor]], vocab: int) -> torch.Tensor:
    """The indices into a [rows, vocab] tensor taken as one dimension (``Tensor.put_``'s) of
    ``parts``' (row, its token ids) pairs (an index_put_ of (row, token) index pairs is many
    times slower on CPU than put_ of these); ``parts`` is not empty."""
    ids = torch.cat([t for _, t in parts])
    counts = torch.tensor([t.numel() for _, t in parts], device=ids.device)
    rows = torch.tensor([i * vocab for i, _ in parts], device=ids.device)
    # a constant number of tensor operations however many rows (one each was slower than the
    # old per-(row, token) index lists for many rows with a short logit_bias)
    return ids + torch.repeat_interleave(rows, counts)


def _fill(x: torch.Tensor, flat: torch.Tensor, value: float) -> None:
    """``value`` at the ``_flat_index`` positions ``flat`` of ``x``."""
    x.put_(flat, torch.tensor(value, dtype=x.dtype, device=x.device).expand(flat.numel()))


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow], idx: Sequence[int]) -> None:
    vocab, dev = logits.shape[-1], logits.device
    for i in idx:
        p = rows[i].params
        row = logits[i]
        out_ids = [t for t in rows[i].output_token_ids if t < vocab]
        out = torch.tensor(out_ids, dtype=torch.long, device=dev)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted({t for t in rows[i].prompt_token_ids if t < vocab} | set(out_ids)),
                dtype=torch.long,
                device=dev,
            )
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
        if out.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(out, minlength=vocab).to(row.dtype)
            row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty


def _mask_stop_tokens(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
    """min_tokens: EOS and stop tokens are impossible until enough tokens were generated.
    Returns the rows masked."""
    vocab, dev = logits.shape[-1], logits.device
    parts: list[tuple[int, torch.Tensor]] = []
    for i, r in enumerate(rows):
        p = r.params
        if p.min_tokens and r.num_output_tokens < p.min_tokens:
            parts.append((i, r.lists.stop_ids(vocab, dev, r.eos_token_ids)))
    if parts:
        _fill(logits, _flat_index(parts, vocab), float("-inf"))
    return [i for i, _ in parts]


# (bitmask [len(rows), ceil(vocab / 32)] int32, the rows it applies to)
GrammarMask = tuple[torch.Tensor, list[int]]


def _apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """Structured outputs: tokens the row's grammar forbids become -inf, after penalties and
    before any choice (greedy, temperature, top-k/p), so every path picks an allowed token.
    Rows not listed are untouched: an unconstrained request samples exactly as without it."""
    from iterserve.structured.grammar import apply_token_bitmask

    bitmask, idx = mask
    if idx:
        # Matchers fill the bitmask on the CPU; a GPU's kernel reads it on the device.
        apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True), idx)


def _apply_allowed_token_ids(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
    """allowed_token_ids: every other token of the row becomes impossible. Returns the rows
    masked."""
    idx = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
    if not idx:
        return idx
    vocab = logits.shape[-1]
    dev = logits.device
    keep = torch.zeros(len(idx), vocab, dtype=torch.bool, device=dev)
    parts = [(j, rows[i].lists.allowed_ids(vocab, dev)) for j, i in enumerate(idx)]
    _fill(keep, _flat_index(parts, vocab), True)
    rsel = torch.tensor(idx, device=dev)
    logits[rsel] = logits[rsel].masked_fill(~keep, float("-inf"))
    return idx


def _ban_bad_words(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
    """bad_words: a word's last token is banned where the output already ends with the
    tokens before it (a one-token word is always banned), so no word is ever completed.
    Returns the rows masked."""
    vocab, dev = logits.shape[-1], logits.device
    parts: list[tuple[int, torch.Tensor]] = []
    for i, r in enumerate(rows):
        lists = r.token_lists
        if lists is None or not lists.has_bad_words:
            continue
        if lists.always_banned:
            parts.append((i, lists.always_banned_ids(vocab, dev)))
        now = [t for t in lists.banned_after_output(r.request) if t < vocab]
        if now:
            parts.append((i, torch.tensor(now, dtype=torch.long, device=dev)))
    if parts:
        _fill(logits, _flat_index(parts, vocab), float("-inf"))
    return [i for i, _ in parts]


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """logit_bias (OpenAI): each listed token's value is added to its logit."""
    vocab, dev = logits.shape[-1], logits.device
    parts: list[tuple[int, torch.Tensor]] = []
    vals: list[torch.Tensor] = []
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            ids, v = r.lists.bias(vocab, dev, logits.dtype)
            parts.append((i, ids))
            vals.append(v)
    if parts:
        flat = _flat_index(parts, vocab)
        logits.put_(flat, torch.cat(vals), accumulate=True)


def _temperatures(params: Sequence[SamplingParams], like: torch.Tensor) -> torch.Tensor:
    """The rows' temperatures [rows], in ``like``'s dtype and on its device."""
    return torch.tensor([p.temperature for p in params], dtype=like.dtype, device=like.device)


def _scale(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` divided in place by each row's temperature: the one division every path
    makes (torch's, IEEE), so a row scores alike whatever else its batch asks for."""
    return logits.div_(_temperatures(params, logits).unsqueeze(1))


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, then top-k and top-p as -inf masks (rows with none skip the
    sort). vLLM's order: top-p's nucleus is taken over what min-p left, renormalised.
    Divides ``logits`` in place."""
    dev = logits.device
    logits = _scale(logits, params)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(mp > 0.0 for mp in min_p):
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * torch.tensor(
            min_p, dtype=probs.dtype, device=dev
        ).unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if any(top_k) or any(tp < 1.0 for tp in top_p):
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)
        mask |= torch.arange(vocab, device=dev).unsqueeze(0) >= ks.unsqueeze(1)
        if any(tp < 1.0 for tp in top_p):
            probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(-1)
            # Drop a token once the mass before it already reaches top_p (the first always stays).
            before = probs.cumsum(-1) - probs
            # a row without top-p never compares: its cumsum's rounding reaches 1.0 before
            # the tail does, which masked tail tokens of that row beside a top-p neighbour
            cut = [tp if tp < 1.0 else math.inf for tp in top_p]
            mask |= before >= torch.tensor(cut, dtype=probs.dtype, device=dev).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


# sample's token for a row whose masks left no token at all (-inf everywhere): the engine ends
# the request with an error instead of emitting a forbidden token (argmax would say 0)
NO_TOKEN = -1


def _no_token_left(logits: torch.Tensor, masked: set[int]) -> torch.Tensor | None:
    """[rows] bool, True where every logit of a ``masked`` row (one a mask touched this
    step) is -inf (None: no row was masked, the usual case, at no cost). Only masks make a
    row -inf throughout; penalties, logit_bias and the top-k / top-p / min-p filters always
    leave a token."""
    if not masked:
        return None
    sel = torch.tensor(sorted(masked), device=logits.device)
    dead = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    dead[sel] = torch.isneginf(logits[sel].amax(-1))
    return dead


def greedy_argmax(logits: torch.Tensor, kern: kernels.Kernels | None) -> torch.Tensor:
    """``logits.argmax(-1)``, the greedy pick (the first index of the maximum); on CPU f32
    through iterserve's kernel, the same result, faster."""
    if (
        kern is not None
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
    ):
        return kern.argmax(logits)
    return logits.argmax(-1)


def plain_greedy(rows: Sequence[SampleRow], grammar_mask: GrammarMask | None = None) -> bool:
    """Whether :func:`sample` returns the logits' argmax for every row and no logprobs: every
    row greedy, nothing that edits the logits (the checks ``sample`` makes, in its order), no
    logprobs. Then the runner can take the argmax in the LM head (``execute(greedy=True)``)."""
    return grammar_mask is None and all(
        not r.params.needs_logprobs
        and not r.params.allowed_token_ids
        and not r.has_bad_words
        and not r.params.logit_bias
        and not r.params.needs_penalties
        and not r.params.min_tokens
        and r.params.greedy
        for r in rows
    )


_KEY_LOW, _KEY_HIGH = -(2**63), 2**63 - 1


def _row_keys(gens: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One 64-bit Philox key a row for this step: row j's from ``gens[j]`` (a seeded request's
    generator), or from torch's default generator where it is None."""
    keys = torch.empty(len(gens), dtype=torch.int64)
    unseeded = [j for j, g in enumerate(gens) if g is None]
    if unseeded:
        keys[unseeded] = torch.randint(_KEY_LOW, _KEY_HIGH, (len(unseeded),))
    for j, gen in enumerate(gens):
        if gen is not None:
            keys[j] = torch.randint(_KEY_LOW, _KEY_HIGH, (1,), generator=gen)
    return keys


def _exponential_noise(
    probs: torch.Tensor, gens: Sequence[torch.Generator | None], kern: kernels.Kernels | None
) -> torch.Tensor:
    """Exp(1) noise shaped as ``probs``: row j from ``gens[j]`` (a seeded request's
    generator), or from torch's default generator where it is None.

    On CPU with iterserve's kernels each row draws one 64-bit key from its generator a step and
    takes -log(1 - v) of the kernel's Philox stream for that key (``Kernels.uniform``): torch's
    CPU ``exponential_`` made the noise of 128 rows cost more than their decode step's forward
    (docs/SPEED.md, "Sampling noise").
    A seed still fixes a request's tokens, whatever else is in the batch."""
    dev, n = probs.device, probs.shape[1]
    if kern is not None and dev.type == "cpu":
        # -log(1 - v), v in (0, 1): finite and positive, fine-grained near 0
        return kern.uniform(_row_keys(gens), n).neg_().log1p_().neg_()
    noise = torch.empty_like(probs)
    unseeded = [j for j, g in enumerate(gens) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), n, device=dev).exponential_()
    for j, gen in enumerate(gens):
        if gen is not None:
            noise[j] = torch.empty(n, device=dev).exponential_(generator=gen)
    return noise


def _filters(params: Sequence[SamplingParams]) -> bool:
    """Whether any row asks for top-k, top-p or min-p (``_filter`` then masks, not only
    divides)."""
    return any(p.top_k or p.top_p < 1.0 or p.min_p > 0.0 for p in params)


def _filtered_race(
    logits: torch.Tensor, params: Sequence[SamplingParams], keys: torch.Tensor,
    kern: kernels.Kernels,
) -> torch.Tensor:  # fmt: skip
    """``_race`` on CPU with the race kernel where some row asks for top-k, top-p or min-p:
    each row's filters become one floor on logits / T, and the race runs over the whole row
    above it. torch's sort of every 49,152-token row (``_filter``) made such a step of 128
    rows ~270-360 ms, about twice the step itself. Min-p comes first (``_filter``'s order):
    it keeps p >= min_p * max p, ties included, a floor at the row's max + log(min_p)
    whatever the normaliser. The floor of a row with top-k is its k-th value above that, or
    with top-p too the last of the nucleus of those (``Kernels.top_k_values``, no sort of
    the row); of a row with top-p alone, the last of the nucleus of what min-p left
    (``Kernels.top_p_floor``, no sort). Of the tokens equal to a top-k or top-p floor, as
    many stay as the sorted cut keeps, the first by index (top-k keeps exactly k)."""
    f32 = torch.float32
    scaled = _scale(logits, params)
    vocab = scaled.shape[1]
    floors = torch.full((len(params),), -math.inf, dtype=f32)
    ties = torch.full((len(params),), -1, dtype=torch.int32)

    def some(idx: list[int]) -> torch.Tensor:  # those rows; no gathered copy of all of them
        return scaled if len(idx) == len(params) else scaled[idx]

    min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        logs = torch.tensor([math.log(params[i].min_p) for i in min_p], dtype=f32)
        # a row with a NaN has no max to measure from: no min-p floor (as before the order
        # changed), rather than a NaN one that no token passes
        floors[min_p] = torch.nan_to_num(some(min_p).amax(-1) + logs, nan=-math.inf)
    mp_floor = floors.clone()  # -inf where a row has no min-p
    has_k = [0 < p.top_k < vocab for p in params]  # top_k 0 or the whole vocabulary: none
    topk = [i for i, k in enumerate(has_k) if k]
    if topk:
        ps = [params[i] for i in topk]
        ks = torch.tensor([p.top_k for p in ps], dtype=torch.int32)
        vals = kern.top_k_values(scaled, torch.tensor(topk), ks)  # largest first, -inf past k
        cut = torch.arange(vals.shape[1]).unsqueeze(0) >= ks.unsqueeze(1)
        cut |= vals < mp_floor[topk].unsqueeze(1)  # the max stays: never all cut
        nucleus = [j for j, p in enumerate(ps) if p.top_p < 1.0]
        if nucleus:  # top-p over the top k, renormalised (as _filter)
            probs = vals[nucleus].masked_fill(cut[nucleus], float("-inf")).softmax(-1)
            before = probs.cumsum(-1) - probs
            top_p = torch.tensor([ps[j].top_p for j in nucleus], dtype=f32).unsqueeze(1)
            cut[nucleus] |= before >= top_p
        last = (~cut).sum(-1, keepdim=True) - 1  # what stays is a prefix, never empty
        floor = vals.gather(1, last)
        floors[topk] = floor.squeeze(1)
        ties[topk] = ((vals == floor) & ~cut).sum(-1).to(torch.int32)
    whole = [i for i, (p, k) in enumerate(zip(params, has_k)) if not k and p.top_p < 1.0]
    # those with min-p take the nucleus of what it left: a copy of their rows alone, masked
    for with_min_p in (False, True):
        part = [i for i in whole if (params[i].min_p > 0.0) == with_min_p]
        if not part:
            continue
        top_p = torch.tensor([params[i].top_p for i in part], dtype=f32)
        rows = some(part)
        if with_min_p:
            rows = rows.masked_fill(rows < mp_floor[part].unsqueeze(1), float("-inf"))
        floors[part], ties[part] = kern.top_p_floor(rows, top_p)
    if min_p:  # no other floor lies below min-p's (a row all -inf or NaN aside): keep it
        under = mp_floor > floors
        floors = torch.where(under, mp_floor, floors)
        ties = torch.where(under, -1, ties).to(torch.int32)
    return kern.race(scaled, torch.ones(len(params), dtype=f32), keys, floors, ties)


def _race(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    gens: Sequence[torch.Generator | None],
    kern: kernels.Kernels | None,
) -> torch.Tensor:
    """One token per row from softmax of the filtered ``logits`` (modified in place) by the
    exponential race: argmax(p / E) with E ~ Exp(1) draws from p.

    On CPU with the AVX-512 kernels the race is one pass over the logits
    (``Kernels.race``, the same noise as ``_exponential_noise``'s): the softmax, noise and
    division over 128 rows took four times as long in torch (docs/SPEED.md, "The race in one
    pass"); top-k, top-p and min-p become a floor on the logits (``_filtered_race``)."""
    if (
        kern is not None
        and kern.has_race
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
    ):
        keys = _row_keys(gens)
        if _filters(params):
            return _filtered_race(logits, params, keys, kern)
        # the kernel divides, the same IEEE division as _scale's
        return kern.race(logits, _temperatures(params, logits), keys)
    probs = _filter(logits, params).softmax(-1)
    return probs.div_(_exponential_noise(probs, gens, kern)).argmax(-1)


@torch.inference_mode()
def sample(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    kern: kernels.Kernels | None = None,
    grammar_mask: GrammarMask | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Picks one token per row of ``logits`` (float32 [len(rows), vocab]); may modify it.
    ``kern``: iterserve's kernels (the runner's), for the greedy argmax. ``grammar_mask``:
    the structured-output rows' allowed tokens (see :func:`_apply_grammar_mask`)."""
    if plain_greedy(rows, grammar_mask):  # the predicate the engine's LM-head argmax takes too
        return greedy_argmax(logits, kern).tolist(), [None] * len(rows)
    params = [r.params for r in rows]
    # best_of > n ranks its candidates by cumulative logprob: computed even if none was asked
    want_logprobs = [p.needs_logprobs for p in params]
    raw_logprobs = logits.log_softmax(-1) if any(want_logprobs) else None

    masked: set[int] = set()  # rows a mask touched: only those can be left with no token
    if any(p.allowed_token_ids for p in params):
        masked.update(_apply_allowed_token_ids(logits, rows))
    if any(r.has_bad_words for r in rows):
        masked.update(_ban_bad_words(logits, rows))
    if any(p.logit_bias for p in params):
        _apply_logit_bias(logits, rows)
    pen = [i for i, p in enumerate(params) if p.needs_penalties]
    if pen:
        _apply_penalties(logits, rows, pen)
    if any(p.min_tokens for p in params):
        masked.update(_mask_stop_tokens(logits, rows))
    if grammar_mask is not None:
        _apply_grammar_mask(logits, grammar_mask)
        masked.update(grammar_mask[1])
    dead = _no_token_left(logits, masked)

    rand = [i for i, p in enumerate(params) if not p.greedy]
    dev = logits.device
    if len(rand) == len(rows):  # every row samples: no greedy argmax, no gathered copy
        tokens = _race(logits, params, [r.generator for r in rows], kern)
    else:
        tokens = greedy_argmax(logits, kern)
        if rand:
            ridx = torch.tensor(rand, device=dev)
            gens = [rows[i].generator for i in rand]
            tokens[ridx] = _race(logits[ridx], [params[i] for i in rand], gens, kern)
    lps: list[TokenLogprobs | None] = [None] * len(rows)
    picked = tokens if dead is None else tokens.masked_fill(dead, NO_TOKEN)
    if raw_logprobs is None:
        token_list: list[int] = picked.tolist()  # the step's one device-to-host sync
        return token_list, lps
    # Logprobs of every row that asked, computed together on the device and fetched with the
    # tokens in ONE transfer (float64 holds token ids and ranks exactly).
    want = [i for i, w in enumerate(want_logprobs) if w]
    rl = raw_logprobs[torch.tensor(want, device=dev)]
    chosen = rl.gather(1, tokens[want].unsqueeze(1)).squeeze(1)
    ranks = (rl >= chosen.unsqueeze(1)).sum(-1)  # ties count ahead of it, as in vLLM
    k = max(params[i].logprobs or 0 for i in want)
    vals, ids = rl.topk(k) if k else (rl[:, :0], rl[:, :0])
    packed = torch.cat(
        [t.double().flatten() for t in (picked, chosen, ranks, vals, ids)]
    ).tolist()  # the step's one device-to-host sync
    n_rows, n_want = len(rows), len(want)
    token_list = [int(t) for t in packed[:n_rows]]
    lp_vals = packed[n_rows : n_rows + n_want]
    rank_vals = packed[n_rows + n_want : n_rows + 2 * n_want]
    top_vals = packed[n_rows + 2 * n_want : n_rows + 2 * n_want + n_want * k]
    top_ids = packed[n_rows + 2 * n_want + n_want * k :]
    for j, i in enumerate(want):
        if token_list[i] == NO_TOKEN:
            continue
        n = params[i].logprobs or 0
        top = [(int(top_ids[j * k + r]), top_vals[j * k + r]) for r in range(n)]
        lps[i] = (token_list[i], lp_vals[j], int(rank_vals[j]), top)
    return token_list, lps
