//! The decoder on golden frames of each layout (written by
//! `scripts/golden/kv-events.py` with msgspec, as the engines encode them),
//! and the index on batches in and out of order.

use std::time::Instant;

use proptest::prelude::*;

use super::key::{chain, extra_digest};
use super::*;

fn golden(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/src/kv_events/golden/{name}.msgpack",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn frames(layout: &str) -> Vec<Batch> {
    (0..3)
        .map(|i| decode_batch(&golden(&format!("{layout}-{i}"))).expect("decodes"))
        .collect()
}

const LAYOUTS: [&str; 4] = [
    "positional-int",
    "positional-bytes",
    "tagged-int",
    "tagged-bytes",
];

#[test]
fn every_layout_decodes_to_the_same_events() {
    let reference = frames("positional-int");
    for layout in LAYOUTS {
        let batches = frames(layout);
        assert_eq!(batches.len(), 3);
        let first = &batches[0];
        assert_eq!(first.ts, 1.5, "{layout}");
        assert_eq!(first.rank, Some(1), "{layout}");
        assert_eq!(batches[1].rank, None, "{layout}");
        let Event::Stored(s) = &first.events[0] else {
            panic!("{layout}: {first:?}")
        };
        assert_eq!(s.token_ids, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!((s.block_size, s.medium, s.parent), (4, Medium::Gpu, None));
        assert_eq!(s.hashes.len(), 2);
        let Event::Stored(cpu) = &first.events[1] else {
            panic!("{layout}")
        };
        assert_eq!(cpu.medium, Medium::Cpu);
        assert_eq!(
            cpu.parent,
            Some(s.hashes[1]),
            "{layout}: chained to the block before"
        );
        // The unknown medium is skipped and counted; the rest stands.
        assert_eq!(batches[1].events.len(), 2, "{layout}: {:?}", batches[1]);
        assert_eq!(batches[1].skipped, [Skipped::UnknownMedium]);
        assert_eq!(batches[2].events, [Event::Cleared]);
        // Integer and byte hashes differ; nothing else does.
        if layout.ends_with("int") {
            assert_eq!(batches, reference, "{layout}");
        }
    }
}

#[test]
fn an_adapters_block_is_keyed_with_its_name_and_salt_once() {
    for layout in LAYOUTS {
        let batch = &frames(layout)[1];
        let Event::Stored(s) = &batch.events[0] else {
            panic!("{layout}")
        };
        // The name is in the event and in the block's extra keys: once.
        assert_eq!(
            s.extras,
            [extra_digest(Some("sql"), ["salt-1"])],
            "{layout}"
        );
    }
}

#[test]
fn sglangs_short_arrays_and_unknown_types_decode() {
    let batch = decode_batch(&golden("sglang-0")).expect("decodes");
    assert_eq!(batch.rank, None);
    // An unknown type is skipped; a block whose tokens do not fill it is
    // malformed.
    assert_eq!(batch.skipped, [Skipped::UnknownType, Skipped::Malformed]);
    assert_eq!(batch.events.len(), 2);
    assert!(
        matches!(&batch.events[0], Event::Stored(s) if s.medium == Medium::Gpu && s.extras == [0, 0])
    );
    assert_eq!(
        batch.events[1],
        Event::Removed {
            hashes: vec![5],
            medium: Medium::Gpu
        }
    );
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    for payload in [
        &b""[..],
        b"\xc1",
        b"\x93\x01",
        b"\xa3abc",
        b"\x92\x01\x02",
        b"\x91\xcb",
    ] {
        assert!(decode_batch(payload).is_err(), "{payload:?}");
    }
}

proptest! {
    #[test]
    fn no_payload_panics_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn no_truncated_or_flipped_golden_frame_panics(cut in 0usize..400, flip in 0usize..400, bit in 0u8..8) {
        for layout in LAYOUTS {
            let mut frame = golden(&format!("{layout}-1"));
            if !frame.is_empty() {
                let at = flip % frame.len();
                frame[at] ^= 1 << bit;
            }
            frame.truncate(cut.min(frame.len()));
            let _ = decode_batch(&frame);
        }
    }
}

fn apply_all(index: &mut EngineIndex, batches: &[Batch]) -> Vec<Change> {
    let mut changes = Vec::new();
    for (seq, batch) in batches.iter().enumerate() {
        assert_eq!(index.order(seq as u64), Order::Next);
        index.apply(seq as u64, batch, Instant::now(), &mut |c| changes.push(c));
    }
    changes
}

#[test]
fn the_index_keys_blocks_by_their_tokens_whatever_the_engine_hashes() {
    let a = chain(None, &[1, 2, 3, 4], 0);
    let b = chain(Some(a), &[5, 6, 7, 8], 0);
    let c = chain(Some(b), &[9, 10, 11, 12], 0);
    let sql = chain(None, &[1, 2, 3, 4], extra_digest(Some("sql"), ["salt-1"]));
    for layout in LAYOUTS {
        let batches = frames(layout);
        let mut index = EngineIndex::new(1_000);
        let changes = apply_all(&mut index, &batches[..2]);
        assert_eq!(
            changes,
            [
                Change::Stored(a, Medium::Gpu),
                Change::Stored(b, Medium::Gpu),
                Change::Stored(c, Medium::Cpu),
                Change::Stored(sql, Medium::Gpu),
                // The removal of a block never stored is nothing.
                Change::Removed(b, Medium::Gpu),
            ],
            "{layout}"
        );
        assert_eq!(
            (index.blocks_on(Medium::Gpu), index.blocks_on(Medium::Cpu)),
            (2, 1)
        );
        assert_eq!(index.block_size(), Some(4));
        let stats = index.stats();
        assert_eq!(
            (stats.batches, stats.blocks_stored, stats.blocks_removed),
            (2, 4, 1)
        );
        assert_eq!(stats.skipped_unknown_medium, 1);
        let mut cleared = Vec::new();
        index.apply(2, &batches[2], Instant::now(), &mut |c| cleared.push(c));
        cleared.sort_by_key(|c| format!("{c:?}"));
        let mut every = vec![
            Change::Removed(a, Medium::Gpu),
            Change::Removed(c, Medium::Cpu),
            Change::Removed(sql, Medium::Gpu),
        ];
        every.sort_by_key(|c| format!("{c:?}"));
        assert_eq!(cleared, every, "{layout}: a clear removes every block");
        assert!(index.is_empty() && index.is_whole());
    }
}

fn stored(hash: u64, parent: Option<u64>, tokens: &[u32]) -> Batch {
    Batch {
        events: vec![Event::Stored(Stored {
            hashes: vec![hash],
            parent,
            token_ids: tokens.to_vec(),
            block_size: tokens.len() as u32,
            medium: Medium::Gpu,
            extras: vec![0],
        })],
        ..Batch::default()
    }
}

#[test]
fn a_gap_is_replayed_or_lost_and_a_restart_empties_the_index() {
    let mut index = EngineIndex::new(100);
    let mut none = |_| {};
    // The first batch the agent sees is 5: 0..5 are in the ring, maybe.
    assert_eq!(index.order(5), Order::Missed { from: 0 });
    for seq in 0..3 {
        assert!(index.wants(seq));
        index.apply(
            seq,
            &stored(seq, None, &[seq as u32]),
            Instant::now(),
            &mut none,
        );
    }
    assert_eq!(index.order(3), Order::Next);
    assert_eq!(index.order(9), Order::Missed { from: 3 });
    assert!(
        !index.wants(2),
        "applied already: a replay's overlap is skipped"
    );
    // The ring no longer has 3..9: the index is dropped, partial until the
    // engine's cache turned over (4 blocks here).
    index.set_engine_blocks(Some(4));
    let mut changes = Vec::new();
    index.lost(9, &mut |c| changes.push(c));
    assert_eq!(changes.len(), 3, "every block held removed: {changes:?}");
    assert!(index.is_empty() && !index.is_whole());
    assert_eq!(index.order(9), Order::Next);
    for seq in 9..13 {
        assert!(!index.is_whole());
        index.apply(
            seq,
            &stored(seq, None, &[seq as u32]),
            Instant::now(),
            &mut none,
        );
    }
    assert!(index.is_whole(), "four stores turned the cache over");
    // The numbering went back: the engine restarted with an empty cache.
    assert_eq!(index.order(0), Order::Restarted);
    index.restarted(&mut none);
    assert!(index.is_empty() && index.is_whole());
    assert_eq!(index.order(0), Order::Next);
    let stats = index.stats();
    assert_eq!((stats.lost, stats.restarts), (1, 1));
}

#[test]
fn a_block_after_a_parent_the_index_lacks_is_an_orphan() {
    let mut index = EngineIndex::new(100);
    let mut changes = Vec::new();
    index.apply(0, &stored(2, Some(1), &[5, 6]), Instant::now(), &mut |c| {
        changes.push(c)
    });
    assert!(changes.is_empty());
    assert_eq!(index.stats().orphans, 1);
}

#[test]
fn past_its_capacity_the_index_forgets_the_least_recently_stored() {
    let mut index = EngineIndex::new(2);
    let mut changes = Vec::new();
    for seq in 0..3 {
        let batch = stored(seq, None, &[seq as u32]);
        index.apply(seq, &batch, Instant::now(), &mut |c| changes.push(c));
    }
    let key = |t: u32| chain(None, &[t], 0);
    assert_eq!(
        changes,
        [
            Change::Stored(key(0), Medium::Gpu),
            Change::Stored(key(1), Medium::Gpu),
            Change::Removed(key(0), Medium::Gpu),
            Change::Stored(key(2), Medium::Gpu),
        ]
    );
    assert_eq!(index.len(), 2);
}
