"""Stable violation kind names.

These strings are a public contract: they are the ``kind`` field of every
report record and the ``kind`` label of ``kvsan_violations_total``.  Never
rename one; add new kinds instead.
"""

FREE_WITH_LIVE_OWNERS = "free_with_live_owners"
REUSE_WITH_LIVE_OWNERS = "reuse_with_live_owners"
EVICT_WITH_LIVE_OWNERS = "evict_with_live_owners"
DOUBLE_RELEASE = "double_release"
REFCOUNT_UNDERFLOW = "refcount_underflow"
INVALID_RELEASE = "invalid_release"
REFCOUNT_MISMATCH = "refcount_mismatch"
FREE_QUEUE_CORRUPTION = "free_queue_corruption"
LEAKED_BLOCKS = "leaked_blocks"
#: a prefix hit served from a block that carries no cache key: the engine's
#: cache map still maps a key to a block whose key was dropped (evicted, or
#: handed out fresh without an eviction), so the hit reads whatever the
#: block holds now
STALE_CACHE_HIT = "stale_cache_hit"

#: Every kind the allocator-side checks can emit, in report order.
ALLOCATOR_KINDS = (
    FREE_WITH_LIVE_OWNERS,
    REUSE_WITH_LIVE_OWNERS,
    EVICT_WITH_LIVE_OWNERS,
    DOUBLE_RELEASE,
    REFCOUNT_UNDERFLOW,
    INVALID_RELEASE,
    REFCOUNT_MISMATCH,
    FREE_QUEUE_CORRUPTION,
    LEAKED_BLOCKS,
    STALE_CACHE_HIT,
)


# device side (worker process)
OVERWRITE_SHARED_BLOCK = "overwrite_shared_block"
CHECKSUM_MISMATCH = "checksum_mismatch"
UNINITIALIZED_HIT = "uninitialized_hit"
#: a block sealed into the prefix cache whose KV the worker computed from
#: input tokens other than its request's (the tokens its cache key names):
#: the memory is handled correctly, the bytes are wrong, and every later
#: hit on the key reads them
INPUT_TOKEN_MISMATCH = "input_token_mismatch"
#: a request whose attention this step reads another extent of its KV than
#: it has written (its sequence length is not its last written position +
#: 1): past it, slots it never wrote (stale KV, another request's, or a
#: freed block's: a use-after-free read); short of it, its newest tokens'
#: KV is ignored
READ_EXTENT_MISMATCH = "read_extent_mismatch"
#: a request whose block-table row (the blocks its attention reads, in
#: order) lists other blocks than the scheduler gave it: a prefix hit's or a
#: moved row's entries are read but never written through, so no write
#: check sees them, and the request reads another block's KV (another
#: request's, a freed one's, the null block's)
BLOCK_TABLE_MISMATCH = "block_table_mismatch"

#: a step that runs a request with another adapter than its own: its
#: adapter id is not among the adapters the worker activated for the step,
#: or the adapter active under that id is another one (name, path).  The
#: request's tokens and the KV it writes (cached under its correct key) are
#: another adapter's
ADAPTER_MISMATCH = "adapter_mismatch"

DEVICE_KINDS = (
    OVERWRITE_SHARED_BLOCK,
    CHECKSUM_MISMATCH,
    UNINITIALIZED_HIT,
    INPUT_TOKEN_MISMATCH,
    READ_EXTENT_MISMATCH,
    BLOCK_TABLE_MISMATCH,
    ADAPTER_MISMATCH,
    REUSE_WITH_LIVE_OWNERS,
)

ALL_KINDS = ALLOCATOR_KINDS + (OVERWRITE_SHARED_BLOCK, CHECKSUM_MISMATCH, UNINITIALIZED_HIT,
                               INPUT_TOKEN_MISMATCH, READ_EXTENT_MISMATCH,
                               BLOCK_TABLE_MISMATCH, ADAPTER_MISMATCH)

# identity audit (EngineCore)
CACHE_KEY_MISMATCH = "cache_key_mismatch"
ALL_KINDS = ALL_KINDS + (CACHE_KEY_MISMATCH,)

#: what a wrong prefix hit is, by the kind that reported it: a bad cache key
#: (the right bytes for some other input) or corruption (the bytes changed
#: under their owners: use-after-free, overwrite).  Leak/accounting kinds are
#: neither.
BAD_CACHE_KEY = "bad_cache_key"
CORRUPTION = "corruption"
CLASS_OF = {
    CACHE_KEY_MISMATCH: BAD_CACHE_KEY,
    FREE_WITH_LIVE_OWNERS: CORRUPTION,
    REUSE_WITH_LIVE_OWNERS: CORRUPTION,
    EVICT_WITH_LIVE_OWNERS: CORRUPTION,
    STALE_CACHE_HIT: CORRUPTION,
    OVERWRITE_SHARED_BLOCK: CORRUPTION,
    CHECKSUM_MISMATCH: CORRUPTION,
    UNINITIALIZED_HIT: CORRUPTION,
    INPUT_TOKEN_MISMATCH: CORRUPTION,
    READ_EXTENT_MISMATCH: CORRUPTION,
    BLOCK_TABLE_MISMATCH: CORRUPTION,
    ADAPTER_MISMATCH: CORRUPTION,
}
