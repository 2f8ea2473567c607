//! Flowgate's own name for a block an engine holds: a chained hash of the
//! block's token ids, what else names it (adapter, cache salt) and the
//! block before it, so one key names a whole prefix as the engines' own
//! block hashes do.
//!
//! The engines' hashes are no use to a router: their algorithm changes
//! between versions and vLLM seeds it at random per process. So the agent
//! computes this key from each stored block's token ids (the events carry
//! them), and the balancer computes the same keys from a request's token
//! ids: a block matches when both hashed the same tokens after the same
//! prefix. The function is Flowgate's contract between its agent and its
//! balancer, versioned by [`KEY_VERSION`] (a balancer ignores an agent's
//! blocks keyed by another version).
//!
//! The mix takes two token ids per 64-bit multiply (8,000 tokens cost about
//! 4,000 multiplies), with a final avalanche per block; keys are 64 bits, so
//! among a million blocks a collision has a chance of about 3·10⁻⁸.

/// A block's key: its prefix, hashed ([module docs](self)).
pub type BlockKey = u64;

/// The version of [`chain`] and [`extra_digest`]: agents and balancers
/// compare keys only at the same version.
pub const KEY_VERSION: u32 = 1;

const SEED: u64 = 0x666c_6f77_6761_7465; // "flowgate"
const MUL: u64 = 0x9E37_79B9_7F4A_7C15;

fn mix(h: u64, x: u64) -> u64 {
    (h ^ x).wrapping_mul(MUL).rotate_left(29)
}

/// splitmix64's finalizer: every bit of the input moves every bit of the
/// key.
fn avalanche(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The key of a block holding `tokens` after the block keyed `parent`
/// (none: a prompt's first block), named besides by `extra`
/// ([`extra_digest`]).
pub fn chain(parent: Option<BlockKey>, tokens: &[u32], extra: u64) -> BlockKey {
    let mut h = mix(SEED, parent.map_or(0, |p| p ^ MUL));
    h = mix(h, extra);
    h = mix(h, tokens.len() as u64);
    let mut pairs = tokens.chunks_exact(2);
    for pair in &mut pairs {
        h = mix(h, u64::from(pair[0]) | (u64::from(pair[1]) << 32));
    }
    if let [last] = pairs.remainder() {
        h = mix(h, u64::from(*last) | (1 << 63));
    }
    avalanche(h)
}

/// The keys of the full blocks of `tokens`, `block_size` tokens each, at
/// most `max_blocks` of them; `extra(i)` names block `i` besides its
/// tokens. What the balancer asks the engines' indexes for.
pub fn prompt_keys(
    tokens: &[u32],
    block_size: usize,
    max_blocks: usize,
    extra: impl Fn(usize) -> u64,
) -> Vec<BlockKey> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = None;
    tokens
        .chunks_exact(block_size)
        .take(max_blocks)
        .enumerate()
        .map(|(i, block)| {
            let key = chain(parent, block, extra(i));
            parent = Some(key);
            key
        })
        .collect()
}

/// What names a block besides its tokens, folded: the adapter it was
/// computed with and the block's other extra keys (a cache salt, an
/// image's hash), in order. 0 when there are none.
pub fn extra_digest<'a>(lora: Option<&str>, extras: impl IntoIterator<Item = &'a str>) -> u64 {
    let mut h = 0;
    if let Some(lora) = lora {
        h = mix(SEED, fold_bytes(lora.as_bytes()) ^ 1);
    }
    for part in extras {
        h = mix(h ^ SEED, fold_bytes(part.as_bytes()));
    }
    if h == 0 {
        0
    } else {
        avalanche(h)
    }
}

/// Bytes folded to 64 bits (an engine's byte hash, a string of an extra
/// key): eight bytes per multiply, the length mixed in.
pub fn fold_bytes(bytes: &[u8]) -> u64 {
    let mut h = mix(SEED, bytes.len() as u64);
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h = mix(h, u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    let mut tail = [0u8; 8];
    let rest = words.remainder();
    tail[..rest.len()].copy_from_slice(rest);
    avalanche(mix(h, u64::from_le_bytes(tail)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_names_its_whole_prefix() {
        let a = chain(None, &[1, 2, 3, 4], 0);
        let b = chain(None, &[1, 2, 3, 5], 0);
        assert_ne!(a, b);
        // Same tokens after another prefix: another block.
        assert_ne!(chain(Some(a), &[9, 9], 0), chain(Some(b), &[9, 9], 0));
        // Same tokens, another adapter or salt: another block.
        let lora = extra_digest(Some("sql"), []);
        assert_ne!(chain(None, &[1, 2, 3, 4], lora), a);
        assert_ne!(extra_digest(None, ["salt"]), extra_digest(Some("salt"), []));
        assert_eq!(extra_digest(None, []), 0);
        // Odd lengths do not collide with a zero token appended.
        assert_ne!(chain(None, &[7], 0), chain(None, &[7, 0], 0));
        assert_ne!(chain(None, &[], 0), chain(None, &[0], 0));
    }

    #[test]
    fn keys_are_stable_across_builds() {
        // The agent and the balancer may be built apart: these values are
        // the contract of KEY_VERSION 1. Change them only with the version.
        assert_eq!(chain(None, &[1, 2, 3, 4], 0), 0xfb96_63f8_4f3b_faf9);
    }

    #[test]
    fn a_prompts_keys_chain_its_full_blocks() {
        let tokens: Vec<u32> = (0..10).collect();
        let keys = prompt_keys(&tokens, 4, 16, |_| 0);
        assert_eq!(keys.len(), 2, "the last two tokens are no full block");
        assert_eq!(keys[0], chain(None, &tokens[..4], 0));
        assert_eq!(keys[1], chain(Some(keys[0]), &tokens[4..8], 0));
        assert_eq!(prompt_keys(&tokens, 4, 1, |_| 0), keys[..1]);
        assert!(prompt_keys(&tokens, 0, 16, |_| 0).is_empty());
    }

    #[test]
    fn byte_hashes_fold_apart() {
        assert_ne!(fold_bytes(b"abcdefgh"), fold_bytes(b"abcdefgi"));
        assert_ne!(fold_bytes(b"a"), fold_bytes(b"a\0"));
        assert_ne!(fold_bytes(&[0u8; 32]), fold_bytes(&[0u8; 31]));
    }
}
