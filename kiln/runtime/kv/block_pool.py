"""The pool of fixed-size KV blocks, their reference counts, and the prefix-cache index.

A full block is keyed by a chained xxh64 over (parent key, its token ids, model id). A hit
is confirmed against the token ids stored with the block, so a hash collision can never
serve the wrong KV. Free blocks wait in an LRU queue; a free block that still holds cached
KV is reused (evicted) only when it reaches the head of the queue.
"""

from __future__ import annotations

import numpy as np
import xxhash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """O(1) doubly linked list of free blocks: pop from the head, append at the tail, and
    remove from the middle when a cached block is hit again."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        b = self.head.next_free
        while b is not self.tail:
            yield b
            b = b.next_free


def hash_block(parent_hash: int | None, token_ids, model_id: str) -> int:
    h = xxhash.xxh64()
    h.update((parent_hash or 0).to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    h.update(model_id.encode())
    return h.intdigest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        self.enable_caching = enable_caching

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: int, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        block = self.cached_block_hash_to_block.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks, only {self.get_num_free_blocks()} free")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a hit on a free block takes it off the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks) -> None:
        """Drop one reference on each; the first given is the first evicted once free."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return  # an identical block is cached already; this one stays private
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached_block_hash_to_block[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = block.token_ids = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no block is referenced."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks
