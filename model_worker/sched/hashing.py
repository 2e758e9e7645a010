"""Chained KV block hashes: the one function both the engine's prefix cache and the router use.

A block's hash covers its parent's hash, its own tokens and an optional extra key (an adapter
name, a cache salt), so equal hashes mean equal prefixes, not merely equal blocks. The hash is
stable across processes and machines (no use of Python's salted hash()), so a router process can
compute from prompt token ids exactly the keys a replica's cache holds.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

# Parent of the first block of every sequence.
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int], extra_key: str | None = None) -> int:
    """64-bit hash of one full block given its parent's hash."""
    # One call over the concatenated bytes: the digest of the same bytes fed in pieces.
    data = parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes()
    if extra_key:
        data += b"\x00extra:" + extra_key.encode("utf-8")
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little")


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, extra_key: str | None = None,
                       parent_hash: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of token_ids, in order; a trailing partial block has none."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start:start + block_size], extra_key)
        hashes.append(parent_hash)
    return hashes
