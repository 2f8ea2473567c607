//! Encoding a text piece by piece, remembering each piece's ids.
//!
//! A Hugging Face tokenizer first cuts its input at its added tokens
//! (`<|im_start|>`, `<s>`, …: each becomes its own id; [`Cutter`] finds
//! the same cuts without the tokenizer's per-byte bookkeeping) and then normalizes,
//! pre-tokenizes and encodes every piece between two of them on its own.
//! So a text's ids are its pieces' ids in order, and a piece's ids depend
//! on the piece alone — with one exception: a Metaspace pre-tokenizer that
//! prepends its space to the *first* piece only. A piece that does not
//! start the text is therefore encoded behind the added token that
//! precedes it (exactly as it stood) and that token's id taken off again;
//! if it is not found there, the whole text is encoded at once instead.
//!
//! Remembered: up to [`IDS_PER_GENERATION`] ids in each of two
//! generations ([`crate::memo`]), keyed by a seeded hash of (the preceding
//! added token, the piece's bytes).

use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::{AddedToken, Tokenizer};

use crate::memo::Memo;
use crate::words::Words;
use crate::Unsupported;

/// The most ids a text is counted to: more than any engine's prefix cache
/// holds of one prompt (128k tokens); the rest of a longer text is not
/// encoded.
pub const MAX_IDS: usize = 131_072;
/// The longest piece encoded: a longer one (a message of megabytes with
/// no added token in it) is encoded to here (at least [`MAX_IDS`] tokens
/// at 4 bytes a token), its last ids dropped (the word cut there may
/// encode otherwise whole) and the text's ids end there.
pub const MAX_PIECE_BYTES: usize = 4 * MAX_IDS;
/// Ids dropped at the end of a cut piece: more than a cut word yields.
const CUT_WORD_IDS: usize = 16;

/// Ids remembered per generation (4 bytes each: 4 MiB, twice, at most,
/// per model): a few hundred conversations of 8k tokens.
pub const IDS_PER_GENERATION: usize = 1 << 20;

/// Pieces' ids remembered (module docs).
pub struct Pieces {
    memo: Memo<Box<[u32]>>,
}

impl Default for Pieces {
    fn default() -> Self {
        Pieces {
            memo: Memo::new(IDS_PER_GENERATION),
        }
    }
}

/// One piece of a text as the tokenizer cuts it.
enum Piece<'t> {
    /// An added token's id.
    Added(u32),
    /// Text between added tokens; `behind`: the added token before it
    /// (`None` for the text's first piece).
    Text {
        text: &'t [u8],
        behind: Option<(&'t [u8], u32)>,
    },
}

impl Pieces {
    /// `text`'s ids (without special tokens added), or `None` when more
    /// than `max` of its bytes are in pieces not remembered.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        cutter: &Cutter,
        whole: &[u8],
        max: usize,
    ) -> Result<Option<Vec<u32>>, Unsupported> {
        let pieces = cutter.cut(whole);
        // Each text piece's key, hashed once (an added token's is unused).
        let keys: Vec<u64> = pieces
            .iter()
            .map(|p| match p {
                Piece::Text { text, behind } => {
                    (self.memo).key((behind.map_or(u32::MAX, |(_, id)| id), text))
                }
                Piece::Added(_) => 0,
            })
            .collect();
        if max < usize::MAX {
            let generations = self.memo.lock();
            let unremembered: usize = pieces
                .iter()
                .zip(&keys)
                .filter_map(|(p, k)| match p {
                    Piece::Text { text, .. } if !generations.contains(*k) => {
                        Some(text.len().min(MAX_PIECE_BYTES))
                    }
                    _ => None,
                })
                .sum();
            if unremembered > max {
                return Ok(None);
            }
        }
        let mut ids = Vec::with_capacity((whole.len() / 3).min(MAX_IDS));
        let mut held = self.memo.held();
        for (piece, &k) in pieces.iter().zip(&keys) {
            if ids.len() >= MAX_IDS {
                break;
            }
            let (text, behind) = match *piece {
                Piece::Added(id) => {
                    ids.push(id);
                    continue;
                }
                Piece::Text { text, behind } => (text, behind),
            };
            if text.len() > MAX_PIECE_BYTES {
                held.release();
                let cut = char_floor(text, MAX_PIECE_BYTES);
                if let Some(mut new) = encode_piece(tokenizer, cutter, &text[..cut], behind)? {
                    new.truncate(new.len().saturating_sub(CUT_WORD_IDS));
                    ids.extend_from_slice(&new);
                }
                break;
            }
            if let Some(known) = held.get(k) {
                ids.extend_from_slice(known);
                continue;
            }
            held.release();
            match encode_piece(tokenizer, cutter, text, behind)? {
                Some(new) => {
                    ids.extend_from_slice(&new);
                    held.insert(k, new.into_boxed_slice());
                }
                // The piece does not encode on its own as it does in the
                // text (module docs): the whole text, remembering nothing.
                None => {
                    let end = char_floor(whole, MAX_PIECE_BYTES);
                    let mut ids = encode_whole(tokenizer, utf8(&whole[..end])?)?;
                    if end < whole.len() {
                        ids.truncate(ids.len().saturating_sub(CUT_WORD_IDS));
                    }
                    ids.truncate(MAX_IDS);
                    return Ok(Some(ids));
                }
            }
        }
        ids.truncate(MAX_IDS);
        Ok(Some(ids))
    }
}

/// Where a tokenizer cuts a text: the same leftmost-longest search for
/// its added tokens matched on the raw text (those not `normalized`) that
/// the tokenizer runs first, cutting at the matches of tokens that match
/// exactly their text (no `lstrip`, `rstrip` or `single_word`, and not a
/// special token the tokenizer is told to encode as text); other matches
/// stay inside a piece, which the tokenizer itself then encodes.
pub struct Cutter {
    search: Option<AhoCorasick>,
    /// Per pattern: its id, and whether the text is cut there.
    tokens: Vec<(u32, bool)>,
    /// A piece's words without `tokenizers`' pipeline, where that gives
    /// its ids ([`Words`]): only if no added token can be left inside a
    /// piece.
    words: Option<Words>,
}

impl Cutter {
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, String> {
        let vocabulary = tokenizer.get_added_vocabulary();
        let as_text = tokenizer.get_encode_special_tokens();
        let all_added = vocabulary.get_added_tokens_decoder();
        let mut added: Vec<(u32, &AddedToken)> = all_added
            .iter()
            .filter(|(_, t)| !t.normalized && !t.content.is_empty())
            .map(|(id, t)| (*id, t))
            .collect();
        added.sort_by_key(|(id, _)| *id);
        let tokens: Vec<(u32, bool)> = added
            .iter()
            .map(|(id, t)| {
                let exact = !(t.lstrip || t.rstrip || t.single_word || (as_text && t.special));
                (*id, exact)
            })
            .collect();
        let every_one_cut = added.len()
            == all_added.values().filter(|t| !t.content.is_empty()).count()
            && tokens.iter().all(|(_, exact)| *exact);
        let words = every_one_cut.then(|| Words::of(tokenizer)).flatten();
        let search = if added.is_empty() {
            None
        } else {
            let patterns = added.iter().map(|(_, t)| t.content.as_str());
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(patterns)
                    .map_err(|e| e.to_string())?,
            )
        };
        Ok(Cutter {
            search,
            tokens,
            words,
        })
    }

    /// `text` cut at its added tokens, as the tokenizer cuts it.
    fn cut<'t>(&self, text: &'t [u8]) -> Vec<Piece<'t>> {
        let mut pieces = Vec::new();
        let mut behind = None;
        let mut from = 0;
        let matches = self.search.iter().flat_map(|s| s.find_iter(text));
        for m in matches {
            let (id, exact) = self.tokens[m.pattern().as_usize()];
            if !exact {
                continue;
            }
            if from < m.start() {
                pieces.push(Piece::Text {
                    text: &text[from..m.start()],
                    behind,
                });
            }
            pieces.push(Piece::Added(id));
            behind = Some((&text[m.start()..m.end()], id));
            from = m.end();
        }
        if from < text.len() {
            pieces.push(Piece::Text {
                text: &text[from..],
                behind,
            });
        }
        pieces
    }
}

/// A piece's ids as they come out in its text; `None` if encoding it
/// behind its added token does not give that token's id first.
fn encode_piece(
    tokenizer: &Tokenizer,
    cutter: &Cutter,
    text: &[u8],
    behind: Option<(&[u8], u32)>,
) -> Result<Option<Vec<u32>>, Unsupported> {
    let text = utf8(text)?;
    // A byte-level tokenizer's piece encodes the same wherever it stands.
    if let Some(ids) = cutter
        .words
        .and_then(|words| words.encode(tokenizer.get_model(), text))
    {
        return ids.map(Some).map_err(Unsupported::Encode);
    }
    let Some((added, id)) = behind else {
        return encode_whole(tokenizer, text).map(Some);
    };
    let ids = encode_whole(tokenizer, &format!("{}{text}", utf8(added)?))?;
    Ok(match ids.split_first() {
        Some((first, rest)) if *first == id => Some(rest.to_vec()),
        _ => None,
    })
}

/// The last char boundary of UTF-8 `text` at or before `at`: not inside
/// a character's continuation bytes.
fn char_floor(text: &[u8], at: usize) -> usize {
    let mut at = at.min(text.len());
    while at < text.len() && (0x80..0xc0).contains(&text[at]) {
        at -= 1;
    }
    at
}

/// A piece as text. The texts cut here are a template's output or a
/// request's prompt, UTF-8 both; they are checked only where encoded, so
/// that a conversation's remembered turns are never read twice.
fn utf8(text: &[u8]) -> Result<&str, Unsupported> {
    std::str::from_utf8(text).map_err(|e| Unsupported::Encode(e.to_string()))
}

fn encode_whole(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, Unsupported> {
    tokenizer
        .encode_fast(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| Unsupported::Encode(e.to_string()))
}
