"""Per-request block tables on top of the BlockPool, with prefix-cache lookups."""

from __future__ import annotations

from kiln.runtime.engine.request import Request
from kiln.runtime.kv.block_pool import BlockPool, KVCacheBlock, hash_block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, model_id: str,
                 enable_caching: bool = True):
        self.block_size = block_size
        self.model_id = model_id
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Chained keys of the request's first full blocks, computed once and extended."""
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.all_token_ids[i * bs:(i + 1) * bs],
                                     self.model_id))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks. Capped at num_tokens - 1: the last
        token is always recomputed, since its logits are needed."""
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        blocks = []
        for i, h in enumerate(self._block_hashes(request, max_blocks)):
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
        # Hits on free blocks leave the free queue, so they are not available for `need`.
        free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need > self.block_pool.get_num_free_blocks() - free_hits:
            return False
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.block_pool.touch(list(new_computed_blocks))
            blocks.extend(new_computed_blocks)
        if need:
            blocks.extend(self.block_pool.get_new_blocks(need))
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's blocks that are full and computed up to num_tokens."""
        bs = self.block_size
        num_full = num_tokens // bs
        blocks = self.req_to_blocks.get(request.request_id, [])
        for i, h in enumerate(self._block_hashes(request, num_full)):
            if blocks[i].block_hash is None:
                self.block_pool.cache_block(
                    blocks[i], h, tuple(request.all_token_ids[i * bs:(i + 1) * bs]))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens positions (drafted slots that
        were rejected; they hold no cached data)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is not None and len(blocks) > keep:
            self.block_pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]

    def free(self, request: Request) -> None:
        # Reversed: the tail of a chain becomes evictable before its head.
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]

    @property
    def usage(self) -> float:
        return self.block_pool.usage()
