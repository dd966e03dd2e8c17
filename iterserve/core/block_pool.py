"""A fixed pool of KV-cache blocks with reference counts and a prefix cache.

Block states (every block is in exactly one):

    used    ref_cnt > 0                     held by one or more requests' block tables
    cached  ref_cnt == 0, has a hash        free but still holding a reusable prefix
    empty   ref_cnt == 0, no hash           free and holding nothing useful

Free blocks (cached + empty) sit in an LRU queue. Empty blocks are put at its front so
they are reused before any cached prefix is evicted; cached blocks go to the back and are
evicted oldest-first when a new block is needed. Cached blocks of a preempted request, which
is certain to come back for them, sit in a second queue that is evicted only when the first
is empty (oldest victim first: preempted requests resume newest first); if that request ends
without resuming (aborted, failed), they go back to the first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept to verify a hash hit token by token


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash: a block's identity includes every token before it."""
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # cached, freed by a preemption: block id -> the preempted request's id
        self._kept: OrderedDict[int, str] = OrderedDict()
        self._cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._kept)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._kept)

    def lookup(
        self, parent_hash: int | None, block_hash: int, token_ids: Sequence[int]
    ) -> int | None:
        """The cached block holding exactly these tokens after this parent, if any."""
        bid = self._cached.get(block_hash)
        if bid is None:
            return None
        blk = self.blocks[bid]
        # Never trust the hash alone: compare the chain link and every token.
        if blk.parent_hash != parent_hash or blk.token_ids != tuple(token_ids):
            return None
        return bid

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` free blocks (evicting cached prefixes LRU-first). Caller checks room."""
        assert n <= self.num_free_blocks, f"asked for {n} blocks, {self.num_free_blocks} free"
        out = []
        for _ in range(n):
            bid, _ = (self._free or self._kept).popitem(last=False)
            blk = self.blocks[bid]
            if blk.block_hash is not None:
                self._evict(blk)
            blk.ref_cnt = 1
            out.append(bid)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds a reference to blocks found in the prefix cache."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_cnt == 0:
                (self._free if bid in self._free else self._kept).pop(bid)
            blk.ref_cnt += 1

    def free(self, block_ids: Iterable[int], keep: str | None = None) -> None:
        """Drops a reference. Pass a request's blocks in reverse order so its tail blocks
        (least likely to be shared) are evicted before its head. ``keep``: the id of a
        preempted request, whose blocks that come free and hold a prefix go to the queue
        evicted last, kept back for it (see ``unkeep``)."""
        for bid in block_ids:
            blk = self.blocks[bid]
            assert blk.ref_cnt > 0, f"double free of block {bid}"
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if blk.block_hash is None:
                    self._free[bid] = None
                    self._free.move_to_end(bid, last=False)
                elif keep is not None:
                    self._kept[bid] = keep
                else:
                    self._free[bid] = None

    def unkeep(self, owner: str) -> None:
        """Moves the blocks still kept back for request ``owner`` to the ordinary free
        queue's back, in the order they were kept (it will not resume). A block taken since
        (a prefix hit, an allocation) left the kept queue; kept again, it is another's."""
        if not self._kept:
            return
        for bid in [b for b, o in self._kept.items() if o == owner]:
            del self._kept[bid]
            self._free[bid] = None

    def cache(
        self, block_id: int, parent_hash: int | None, block_hash: int, token_ids: Sequence[int]
    ) -> None:
        """Registers a full block's contents so later requests can reuse it."""
        blk = self.blocks[block_id]
        if blk.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; keep the first
        blk.block_hash = block_hash
        blk.parent_hash = parent_hash
        blk.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id

    def forget(self, block_ids: Iterable[int]) -> None:
        """Unregisters these blocks' cached contents (their KV was never written)."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.block_hash is not None:
                self._evict(blk)

    def _evict(self, blk: KVBlock) -> None:
        assert blk.block_hash is not None
        del self._cached[blk.block_hash]
        blk.block_hash = blk.parent_hash = None
        blk.token_ids = None

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (after a failed step the contents are suspect)."""
        for blk in self.blocks:
            if blk.block_hash is not None:
                self._evict(blk)
        # A victim's blocks were kept back only for their contents, which are gone now.
        for bid in self._kept:
            self._free[bid] = None
            self._free.move_to_end(bid, last=False)
        self._kept.clear()

    def check_integrity(self) -> None:
        free = set(self._free) | set(self._kept)
        assert len(free) == len(self._free) + len(self._kept)
        for blk in self.blocks:
            if blk.ref_cnt < 0:
                raise AssertionError(f"block {blk.block_id} has ref_cnt {blk.ref_cnt}")
            if (blk.ref_cnt == 0) != (blk.block_id in free):
                raise AssertionError(
                    f"block {blk.block_id} ref_cnt={blk.ref_cnt} but free={blk.block_id in free}"
                )
            if blk.block_hash is not None and self._cached.get(blk.block_hash) != blk.block_id:
                raise AssertionError(f"block {blk.block_id} hash not registered")
        for h, bid in self._cached.items():
            if self.blocks[bid].block_hash != h:
                raise AssertionError(f"cache entry {h} points at block {bid} with another hash")
