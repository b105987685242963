"""Per-request block tables on top of the BlockPool, with prefix-cache lookups.

A step's bookkeeping is proportional to what the step changed, not to the requests'
contexts: each request's block ids are also a row of one numpy array the runner gathers
(BlockTables), and the prefix cache indexes only the blocks filled since the last step."""

from __future__ import annotations

import numpy as np

from kiln.runtime.engine.request import Request
from kiln.runtime.kv.block_pool import BlockPool, KVCacheBlock, hash_block


class BlockTables:
    """Every request's block ids as one row of a [rows, width] int32 array: a request holds a
    row from its first block to its free, extended and truncated in place, and a step's
    tables are one gather of its rows (vLLM's persistent block table). Row 0 stays empty,
    for a request that holds no blocks."""

    def __init__(self, rows: int = 16, width: int = 16):
        self.ids = np.zeros((rows, width), dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self._free = list(range(rows - 1, 0, -1))

    def add(self) -> int:
        if not self._free:
            rows = len(self.ids)
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def extend(self, row: int, blocks: list[KVCacheBlock]) -> None:
        size = int(self.lengths[row])
        end = size + len(blocks)
        if end > self.ids.shape[1]:
            grown = np.zeros((len(self.ids), max(end, 2 * self.ids.shape[1])), dtype=np.int32)
            grown[:, :self.ids.shape[1]] = self.ids
            self.ids = grown
        self.ids[row, size:end] = [b.block_id for b in blocks]
        self.lengths[row] = end

    def truncate(self, row: int, size: int) -> None:
        self.ids[row, size:self.lengths[row]] = 0  # a gather reads zeros past a row's blocks
        self.lengths[row] = size

    def release(self, row: int) -> None:
        self.truncate(row, 0)
        self._free.append(row)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), the longest's blocks] int32, zero past each row's blocks: a copy."""
        return self.ids[rows, :int(self.lengths[rows].max(initial=0))]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, model_id: str,
                 enable_caching: bool = True):
        self.block_size = block_size
        self.model_id = model_id
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.tables = BlockTables()
        self.req_to_row: dict[str, int] = {}  # its row of `tables`
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
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not new_computed_blocks and blocks is not None and \
                request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
            return True  # a decode row inside its last block: most rows of most steps
        need = self.num_blocks_needed(request, num_new_tokens, new_computed_blocks)
        if not need and not new_computed_blocks:
            return True
        # Hits on free blocks leave the free queue, so they are not available for `need`.
        free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need > self.block_pool.get_num_free_blocks() - free_hits:
            return False
        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
            self.req_to_row[rid] = self.tables.add()
        row = self.req_to_row[rid]
        if new_computed_blocks:
            self.block_pool.touch(list(new_computed_blocks))
            blocks.extend(new_computed_blocks)
            self.tables.extend(row, list(new_computed_blocks))
        if need:
            new_blocks = self.block_pool.get_new_blocks(need)
            blocks.extend(new_blocks)
            self.tables.extend(row, new_blocks)
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
            self.tables.truncate(self.req_to_row[rid], keep)  # computed (and cached) stay

    def free(self, request: Request) -> None:
        # Reversed: the tail of a chain becomes evictable before its head.
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        row = self.req_to_row.pop(rid, None)
        if row is not None:
            self.tables.release(row)
        self.num_cached_blocks.pop(rid, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]

    def block_tables(self, requests: list[Request]) -> np.ndarray:
        """[len(requests), the longest's blocks] int32: each request's block ids, zero past
        them (a copy)."""
        rows = self.req_to_row
        return self.tables.gather(np.fromiter((rows.get(r.request_id, 0) for r in requests),
                                              np.int64, len(requests)))

    @property
    def usage(self) -> float:
        return self.block_pool.usage()
