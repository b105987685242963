"""Per-request block tables on top of the BlockPool, with prefix-cache lookups.

A step's bookkeeping is proportional to what the step changed, not to the requests'
contexts: each request's block ids are also kept in a numpy array the runner copies rows of
(BlockTable), and the prefix cache indexes only the blocks filled since the last step."""

from __future__ import annotations

import numpy as np

from kiln.runtime.engine.request import Request
from kiln.runtime.kv.block_pool import BlockPool, KVCacheBlock, hash_block


class BlockTable:
    """One request's block ids, appended and truncated in place: [capacity] int32, and
    `view` the [size] in use (kept, not cut per read: the runner reads every row's a step)."""

    __slots__ = ("ids", "view")

    def __init__(self):
        self.ids = np.empty(16, dtype=np.int32)
        self.view = self.ids[:0]

    def extend(self, blocks: list[KVCacheBlock]) -> None:
        size = len(self.view)
        end = size + len(blocks)
        if end > len(self.ids):
            self.ids = np.resize(self.ids, max(end, 2 * len(self.ids)))
        self.ids[size:end] = [b.block_id for b in blocks]
        self.view = self.ids[:end]

    def truncate(self, size: int) -> None:
        self.view = self.ids[:size]


_NO_BLOCKS = np.empty(0, dtype=np.int32)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, model_id: str,
                 enable_caching: bool = True):
        self.block_size = block_size
        self.model_id = model_id
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_table: dict[str, BlockTable] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already indexed

    def _extend_block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Chained keys of the request's full blocks, computed once and extended to at
        least num_full_blocks (the list itself, possibly longer)."""
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.all_token_ids[i * bs:(i + 1) * bs],
                                     self.model_id))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks. Capped at num_tokens - 1: the last
        token is always recomputed, since its logits are needed."""
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        blocks = []
        hashes = self._extend_block_hashes(request, max_blocks)
        for i in range(max_blocks):
            h = hashes[i]
            token_ids = tuple(request.all_token_ids[i * bs:(i + 1) * bs])
            block = self.block_pool.get_cached_block(h, token_ids)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * bs

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          new_computed_blocks: list[KVCacheBlock] = ()) -> int:
        have = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size \
            + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] = ()) -> bool:
        """Give the request blocks for num_new_tokens more tokens; False (and no change) if
        the pool cannot. new_computed_blocks are prefix-cache hits it takes a reference on."""
        need = self.num_blocks_needed(request, num_new_tokens, new_computed_blocks)
        if not need and not new_computed_blocks:  # a decode row inside its last block
            return True
        # Hits on free blocks leave the free queue, so they are not available for `need`.
        free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need > self.block_pool.get_num_free_blocks() - free_hits:
            return False
        rid = request.request_id
        blocks = self.req_to_blocks.setdefault(rid, [])
        table = self.req_to_table.get(rid)
        if table is None:
            table = self.req_to_table[rid] = BlockTable()
        if new_computed_blocks:
            self.block_pool.touch(list(new_computed_blocks))
            blocks.extend(new_computed_blocks)
            table.extend(list(new_computed_blocks))
        if need:
            new_blocks = self.block_pool.get_new_blocks(need)
            blocks.extend(new_blocks)
            table.extend(new_blocks)
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's blocks that are full and computed up to num_tokens (those
        filled since the last call; cache hits are indexed already)."""
        bs, rid = self.block_size, request.request_id
        num_full = num_tokens // bs
        done = self.num_cached_blocks.get(rid, 0)
        if num_full <= done:
            return
        blocks = self.req_to_blocks[rid]
        hashes = self._extend_block_hashes(request, num_full)
        for i in range(done, num_full):
            if blocks[i].block_hash is None:
                self.block_pool.cache_block(
                    blocks[i], hashes[i], tuple(request.all_token_ids[i * bs:(i + 1) * bs]))
        self.num_cached_blocks[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens positions (drafted slots that
        were rejected; they hold no cached data)."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        keep = -(-num_tokens // self.block_size)
        if blocks is not None and len(blocks) > keep:
            self.block_pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]
            self.req_to_table[rid].truncate(keep)  # computed (and cached) blocks all stay

    def free(self, request: Request) -> None:
        # Reversed: the tail of a chain becomes evictable before its head.
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self.req_to_table.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]

    def block_tables(self, requests: list[Request]) -> list[np.ndarray]:
        """Each request's block ids, [num_blocks] int32: views, valid until its next
        allocation or trim."""
        tables = self.req_to_table
        return [tables[r.request_id].view if r.request_id in tables else _NO_BLOCKS
                for r in requests]

    @property
    def usage(self) -> float:
        return self.block_pool.usage()
