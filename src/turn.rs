//! Conversations sent without a session key, followed by their prompts.
//!
//! A client re-sends the whole conversation every turn, with the answer it
//! got and what followed (a tool's output, the user's next message)
//! appended; so a turn's prompt up to its last assistant message is the
//! prompt of the conversation's previous turn. [`TurnKeys`] names both:
//! [`TurnKeys::this`] (the whole prompt) is what the next turn will look
//! up, [`TurnKeys::previous`] what this turn looks up. Where balancers share
//! where turns went (the session store), each served turn records where
//! `this` went and the next looks up `previous`, so a conversation without
//! a key is followed whichever balancer its turns reach. Within one
//! balancer its own prefix index does that already.
//!
//! Two conversations with the same previous prompt share that prompt's
//! cache, so they may share a key: a key names a prompt, not a client.
//!
//! The keys come from the prefix index's block chain ([`crate::prefix`]):
//! a prompt's first `n` bytes are named by the chain hash of their full
//! blocks and the bytes after, so naming both prefixes costs hashing less
//! than two blocks more. Only prompts of at least one full block are
//! named: a shorter one has little cache to follow, and the prefix index
//! ignores it too. The text is the prefix hashing's (its first
//! `block_bytes × max_blocks` bytes), so the turns of a conversation longer
//! than that share one key, which names where its latest turn went.

use std::hash::{DefaultHasher, Hash, Hasher};

use crate::openai::PromptLength;
use crate::prefix::PrefixConfig;

/// A keyless conversation's turn, named by prompts (hashed; scoped to the
/// tenant once admitted, [`TurnKeys::scoped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnKeys {
    /// This turn's whole prompt: the next turn's `previous`.
    pub this: u64,
    /// The previous turn's prompt; `None` for a first turn (no answer in
    /// the prompt yet) or one whose previous prompt was too short.
    pub previous: Option<u64>,
}

impl TurnKeys {
    /// The keys of a prompt whose text (cut as prefix hashing cuts it) is
    /// `text`, hashed into `blocks` by [`crate::prefix::block_hashes`] with
    /// `config`, and whose whole length is `length`.
    pub fn of(
        text: &[u8],
        blocks: &[u64],
        config: &PrefixConfig,
        length: PromptLength,
    ) -> Option<TurnKeys> {
        let block = config.block_bytes;
        if block == 0 || text.len() < block {
            return None;
        }
        let key = |n: usize| prefix_key(text, blocks, block, n);
        let previous = length
            .last_answer_at
            .map(|at| usize::try_from(at).unwrap_or(usize::MAX).min(text.len()))
            .filter(|&n| n >= block);
        Some(TurnKeys {
            this: key(text.len()),
            previous: previous.map(key),
        })
    }

    /// The keys of the same turn sent by `tenant`: one tenant's prompts
    /// never name another's.
    pub fn scoped(self, tenant: &str) -> TurnKeys {
        TurnKeys {
            this: crate::session::scoped(tenant, self.this),
            previous: self.previous.map(|p| crate::session::scoped(tenant, p)),
        }
    }
}

/// What a request looks up in the session store before it is placed, and
/// records there once served: its session's key both times, or for a
/// keyless conversation its previous turn's prompt, then its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreKeys {
    pub look_up: Option<u64>,
    pub record: Option<u64>,
}

impl StoreKeys {
    pub fn of(session: Option<u64>, turn: Option<TurnKeys>) -> StoreKeys {
        match (session, turn) {
            (Some(s), _) => StoreKeys {
                look_up: Some(s),
                record: Some(s),
            },
            (None, Some(t)) => StoreKeys {
                look_up: t.previous,
                record: Some(t.this),
            },
            (None, None) => StoreKeys::default(),
        }
    }
}

/// The name of `text[..n]`: the chain hash of its full blocks, then the
/// rest. Hashed apart from session keys (a leading tag).
fn prefix_key(text: &[u8], blocks: &[u64], block: usize, n: usize) -> u64 {
    let full = n / block;
    let mut h = DefaultHasher::new();
    "turn".hash(&mut h);
    match full.checked_sub(1).map(|last| blocks.get(last)) {
        None => text[..n].hash(&mut h),
        Some(Some(chain)) => {
            chain.hash(&mut h);
            text[full * block..n].hash(&mut h);
        }
        // The index is off (no chain): the whole text.
        Some(None) => text[..n].hash(&mut h),
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::block_hashes;
    use proptest::prelude::*;

    const CONFIG: PrefixConfig = PrefixConfig {
        block_bytes: 16,
        max_blocks: 8,
        capacity_blocks: 64,
    };

    /// The keys of a prompt of the whole text `full` whose last answer
    /// begins at `answer_at`.
    fn keys(full: &[u8], answer_at: Option<usize>, config: &PrefixConfig) -> Option<TurnKeys> {
        let limit = config.block_bytes * config.max_blocks;
        let text = &full[..full.len().min(limit)];
        let length = PromptLength {
            bytes: full.len() as u64,
            last_answer_at: answer_at.map(|a| a as u64),
        };
        TurnKeys::of(text, &block_hashes(text, config), config, length)
    }

    #[test]
    fn a_short_prompt_is_not_followed() {
        assert_eq!(keys(b"too short", None, &CONFIG), None);
        let first = keys(&[b'a'; 20], Some(10), &CONFIG).expect("a full block");
        assert_eq!(first.previous, None, "the previous turn was too short");
    }

    #[test]
    fn the_index_switched_off_still_names_turns() {
        let off = PrefixConfig {
            capacity_blocks: 0,
            ..CONFIG
        };
        let first = b"system prompt, first question.";
        let mut second = first.to_vec();
        second.extend_from_slice(b"the answer. the next question");
        let a = keys(first, None, &off).unwrap();
        let b = keys(&second, Some(first.len()), &off).unwrap();
        assert_eq!(b.previous, Some(a.this));
        assert_ne!(b.this, a.this);
    }

    #[test]
    fn tenants_name_the_same_prompt_apart() {
        let k = keys(&[b'x'; 40], Some(20), &CONFIG).unwrap();
        let (a, b) = (k.scoped("alpha"), k.scoped("beta"));
        assert_ne!(a.this, b.this);
        assert_ne!(a.previous, b.previous);
        assert_eq!(a, k.scoped("alpha"));
    }

    #[test]
    fn a_session_key_is_what_the_store_keeps() {
        let turn = TurnKeys {
            this: 2,
            previous: Some(1),
        };
        let keyed = StoreKeys::of(Some(9), Some(turn));
        assert_eq!((keyed.look_up, keyed.record), (Some(9), Some(9)));
        let keyless = StoreKeys::of(None, Some(turn));
        assert_eq!((keyless.look_up, keyless.record), (Some(1), Some(2)));
        let first = StoreKeys::of(
            None,
            Some(TurnKeys {
                previous: None,
                ..turn
            }),
        );
        assert_eq!((first.look_up, first.record), (None, Some(2)));
        assert_eq!(StoreKeys::of(None, None), StoreKeys::default());
    }

    proptest! {
        /// Each turn looks up exactly what the turn it continues recorded,
        /// however long the conversation grows past the hashed text.
        #[test]
        fn each_turn_finds_the_one_before(
            turns in proptest::collection::vec(
                (proptest::collection::vec(any::<u8>(), 1..40), proptest::collection::vec(any::<u8>(), 0..40)),
                2..8,
            ),
        ) {
            let mut prompt: Vec<u8> = Vec::new();
            let mut recorded: Option<TurnKeys> = None;
            let mut answer_at = None;
            for (answer, next) in turns {
                if !prompt.is_empty() {
                    answer_at = Some(prompt.len());
                    prompt.extend_from_slice(&answer);
                }
                prompt.extend_from_slice(&next);
                prompt.push(b'.');
                let Some(now) = keys(&prompt, answer_at, &CONFIG) else { continue };
                if let (Some(before), Some(at)) = (recorded, answer_at) {
                    if at >= CONFIG.block_bytes {
                        prop_assert_eq!(now.previous, Some(before.this));
                    }
                }
                recorded = Some(now);
            }
        }

        /// Different previous prompts (of one length, within the hashed
        /// text) are named apart.
        #[test]
        fn different_prompts_are_named_apart(
            a in proptest::collection::vec(any::<u8>(), 16..128),
            flip in any::<prop::sample::Index>(),
        ) {
            let mut b = a.clone();
            let i = flip.index(b.len());
            b[i] ^= 1;
            prop_assert_ne!(keys(&a, None, &CONFIG).unwrap().this, keys(&b, None, &CONFIG).unwrap().this);
        }
    }
}
