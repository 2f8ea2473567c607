#!/usr/bin/env python3
"""Writes the golden KV-event frames the core's decoder tests read
(src/kv_events/golden/*.msgpack), encoded the way the engines encode them.

vLLM encodes its batches with msgspec (`msgspec.msgpack.Encoder`) from
`msgspec.Struct` classes: `array_like=True, tag=True` before its PR #42892
(May 2026) and SGLang today, tagged maps (`tag_field="type"`) after. The
classes below restate those layouts field by field (names and order from
vLLM's `vllm/distributed/kv_events.py`); run with `pip install msgspec`:

    python3 scripts/golden/kv-events.py src/kv_events/golden
"""
import sys
from pathlib import Path

import msgspec


def classes(array_like):
    opts = dict(omit_defaults=True, gc=False)
    if array_like:
        opts.update(array_like=True, tag=True)
    else:
        opts.update(tag=True, tag_field="type")

    class KVCacheEvent(msgspec.Struct, **opts):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list
        parent_block_hash: object
        token_ids: list
        block_size: int
        lora_id: object = None
        medium: object = None
        lora_name: object = None
        extra_keys: object = None
        group_idx: int = 0

    class BlockRemoved(KVCacheEvent):
        block_hashes: list
        medium: object = None
        group_idx: int = 0

    class AllBlocksCleared(KVCacheEvent):
        pass

    batch_opts = dict(omit_defaults=True, gc=False)
    if array_like:
        batch_opts["array_like"] = True

    class KVEventBatch(msgspec.Struct, **batch_opts):
        ts: float
        events: list
        data_parallel_rank: object = None

    return BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch


def frames(array_like, int_hashes):
    Stored, Removed, Cleared, Batch = classes(array_like)
    h = (lambda n: n) if int_hashes else (lambda n: n.to_bytes(32, "big"))
    # Two blocks of 4 tokens, a third after them on the CPU, one block of
    # an adapter with a cache salt, an unknown medium, a removal, a clear.
    return [
        Batch(ts=1.5, events=[
            Stored(block_hashes=[h(11), h(12)], parent_block_hash=None,
                   token_ids=[1, 2, 3, 4, 5, 6, 7, 8], block_size=4, medium="GPU"),
            Stored(block_hashes=[h(13)], parent_block_hash=h(12),
                   token_ids=[9, 10, 11, 12], block_size=4, medium="CPU"),
        ], data_parallel_rank=1),
        Batch(ts=2.5, events=[
            Stored(block_hashes=[h(21)], parent_block_hash=None,
                   token_ids=[1, 2, 3, 4], block_size=4, lora_id=7,
                   lora_name="sql", extra_keys=[["sql", "salt-1"]]),
            Stored(block_hashes=[h(31)], parent_block_hash=None,
                   token_ids=[1, 2, 3, 4], block_size=4, medium="DISK"),
            Removed(block_hashes=[h(12), h(99)], medium="GPU"),
        ]),
        Batch(ts=3.5, events=[Cleared()]),
    ]


def main(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    enc = msgspec.msgpack.Encoder()
    for layout, array_like in (("positional", True), ("tagged", False)):
        for hashes, ints in (("int", True), ("bytes", False)):
            for i, batch in enumerate(frames(array_like, ints)):
                (out / f"{layout}-{hashes}-{i}.msgpack").write_bytes(enc.encode(batch))
    # SGLang's: positional, integer hashes, trailing fields left off (no
    # medium, no rank), and an event type Flowgate does not know.
    sglang = [0.5, [
        ["BlockStored", [5, 6], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None],
        ["BlockPinned", [5]],
        ["BlockRemoved", [5]],
        ["BlockStored", [7], 6, [9, 10, 11], 4],
    ]]
    (out / "sglang-0.msgpack").write_bytes(enc.encode(sglang))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "src/kv_events/golden")
