"""Per-request block tables over the shared BlockPool, with automatic prefix caching."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from iterserve.core.block_pool import BlockPool, hash_block
from iterserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Hands out blocks so that a request's block table always covers the tokens it has
    computed plus those scheduled this step. Full blocks are registered in the prefix cache
    as soon as they are scheduled (their KV is written by the step that computes them, before
    any attention in the same layer reads it)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def _ensure_hashes(self, req: Request, num_full_blocks: int) -> None:
        hashes, bs, toks = req.block_hashes, self.block_size, req.all_token_ids
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, toks[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of ``req`` (whole blocks), never covering its last token,
        which is always recomputed so the step yields logits to sample from. A request that
        wants prompt logprobs and has generated nothing yet gets no hit (as in vLLM): its
        prompt is recomputed, since the logprobs come out of the prefill forward."""
        if not self.enable_prefix_caching or (
            req.params.prompt_logprobs is not None and not req.num_output_tokens
        ):
            return [], 0
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        self._ensure_hashes(req, max_blocks)
        hits: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            h = req.block_hashes[i]
            bid = self.pool.lookup(parent, h, req.all_token_ids[i * bs : (i + 1) * bs])
            if bid is None:
                break
            hits.append(bid)
            parent = h
        return hits, len(hits) * bs

    def num_free_after_hits(self, computed_blocks: Sequence[int]) -> int:
        """Free blocks left once ``computed_blocks`` (prefix hits) are taken: hits that are
        cached-but-free leave the free queue when touched."""
        return self.pool.num_free_blocks - sum(
            1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0
        )

    def _blocks_needed(
        self, req: Request, total: int, computed_blocks: Sequence[int]
    ) -> int | None:
        """New blocks for a table covering ``total`` tokens, or None if the pool is short."""
        held = len(self.req_blocks.get(req.request_id, ())) + len(computed_blocks)
        need = cdiv(total, self.block_size) - held
        if need <= 0:
            return 0  # free >= reclaimed always holds, so no room check is needed
        if need > self.num_free_after_hits(computed_blocks):
            return None
        return need

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Grows ``req``'s block table to cover its computed tokens, ``computed_blocks``
        (prefix hits, when admitting) and ``num_new_tokens``. False, changing nothing, if the
        pool is short."""
        # Called for every scheduled request every step: the common decode case (no new
        # block, no newly full block) returns after a few integer operations.
        bs = self.block_size
        total = req.num_computed_tokens + len(computed_blocks) * bs + num_new_tokens
        rid = req.request_id
        blocks = self.req_blocks.get(rid)
        first = blocks is None
        if blocks is not None and not computed_blocks and total <= len(blocks) * bs:
            need: int | None = 0  # the table already covers the new tokens
        else:
            need = self._blocks_needed(req, total, computed_blocks)
            if need is None:
                return False
            if blocks is None:
                blocks = self.req_blocks[rid] = []
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
        if first and req.num_preemptions:
            # resumed: what was kept back for it and not hit now (a broken chain, prompt
            # logprobs) would stay kept for a request that no longer wants it
            self.pool.unkeep(rid)
        if need:
            blocks.extend(self.pool.allocate(need))
        if self.enable_prefix_caching:
            num_full = total // bs
            if num_full > self._num_registered.get(rid, 0):
                self._register_full_blocks(req, blocks, num_full)
        return True

    def _register_full_blocks(self, req: Request, blocks: list[int], num_full: int) -> None:
        rid, bs = req.request_id, self.block_size
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        self._ensure_hashes(req, num_full)
        hashes = req.block_hashes
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else None
            self.pool.cache(blocks[i], parent, hashes[i], req.all_token_ids[i * bs : (i + 1) * bs])
        self._num_registered[rid] = num_full

    def free(self, req: Request, discard_uncomputed: bool = False, keep: bool = False) -> None:
        """Drops ``req``'s blocks (cached prefixes stay for later hits). With
        ``discard_uncomputed`` the step that was to write the KV of its tokens past
        ``num_computed_tokens`` will not run (the scheduler took them back), so the blocks
        registered for those tokens are forgotten rather than left as false prefix hits.
        ``keep`` (a preemption: ``req`` will come back for them): its cached blocks are
        evicted only after every other free block."""
        rid = req.request_id
        blocks = self.req_blocks.pop(rid, None)
        self._num_registered.pop(rid, None)
        if blocks and discard_uncomputed:
            self.pool.forget(blocks[req.num_computed_tokens // self.block_size :])
        if blocks:
            self.pool.free(reversed(blocks), keep=rid if keep else None)
        else:
            # it ended while preempted (aborted, failed): what was kept for it is not wanted
            self.pool.unkeep(rid)

    def blocks_to_grow(self, req: Request, num_tokens: int) -> int:
        """New blocks ``req`` needs to hold all its tokens plus ``num_tokens`` more."""
        return cdiv(req.num_tokens + num_tokens, self.block_size) - len(
            self.block_table(req.request_id)
        )

    def preemption_loss(self, req: Request, shortage: int) -> int:
        """``req``'s computed tokens that would not be found again in the prefix cache if it
        were preempted now and ``shortage`` blocks were then taken before it resumes: its
        partial last block at once, then its own blocks tail-first (blocks other requests
        also hold stay); a hit ends at the first lost block."""
        computed = req.num_computed_tokens
        if not self.enable_prefix_caching or (
            req.params.prompt_logprobs is not None and not req.num_output_tokens
        ):
            return computed  # no hit at resume (see get_computed_blocks)
        bs = self.block_size
        blocks = self.block_table(req.request_id)
        first_lost = min(computed // bs, len(blocks))  # the first block not found again
        ref = self.pool.blocks
        for i in range(first_lost - 1, -1, -1):
            if shortage <= 0:
                break
            if ref[blocks[i]].ref_cnt == 1:
                first_lost = i
                shortage -= 1
        return computed - first_lost * bs

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self._num_registered = {rid: 0 for rid in self.req_blocks}

    def check_integrity(self, requests: Iterable[Request] = ()) -> None:
        """Asserts the accounting: each block's ref count equals the number of block tables
        holding it, free + used == total, and each listed request's table covers exactly its
        computed tokens (call between steps)."""
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b] += 1
        for blk in self.pool.blocks:
            if blk.ref_cnt != refs[blk.block_id]:
                raise AssertionError(
                    f"block {blk.block_id}: ref_cnt {blk.ref_cnt} but held by "
                    f"{refs[blk.block_id]} tables"
                )
        used = sum(1 for r in refs if r > 0)
        if used + self.pool.num_free_blocks != self.pool.num_blocks:
            raise AssertionError(
                f"used {used} + free {self.pool.num_free_blocks} != {self.pool.num_blocks}"
            )
        for req in requests:
            n = len(self.req_blocks.get(req.request_id, ()))
            if n != self.blocks_for(req.num_computed_tokens):
                raise AssertionError(
                    f"{req.request_id}: {n} blocks for {req.num_computed_tokens} computed tokens"
                )
