//! A piece's words for byte-level BPE tokenizers, cut without `tokenizers`'
//! pipeline.
//!
//! The tokenizers most chat models ship (GPT-2's, Llama 3's, Qwen2's and
//! their descendants) cut a piece into words with one regular expression,
//! map each byte of a word to a printable character and hand each word to
//! the BPE model. `tokenizers` runs that expression on a backtracking
//! engine (its `\s+(?!\S)` needs a look-ahead) and keeps every byte's
//! alignment for offsets the balancer never reads: three quarters of
//! encoding a conversation's new turn went there, the BPE model a tenth
//! (callgrind, 2026-11-30). On an ASCII piece the three expressions are a
//! few comparisons a byte, written out below; the words still go to the
//! tokenizer's own BPE model (its merges, its cache of words).
//!
//! Only where that gives the ids `tokenizers` gives: the pre-tokenizer is
//! one of the three exactly as their `tokenizer.json` writes it, the
//! normalizer leaves ASCII as it is (none, or a Unicode normal form), and
//! every added token is cut out of the text before ([`crate::pieces`]); a
//! piece with a byte past ASCII goes through `tokenizers` as before. The
//! tests hold the cuts against `tokenizers` itself on random pieces.

use serde_json::{json, Value};
use tokenizers::{Model, Tokenizer};

/// GPT-2's expression, which `tokenizers`' `ByteLevel` pre-tokenizer runs
/// when `use_regex` is set.
pub const GPT2: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's (and OpenAI's cl100k's): runs of up to three digits.
pub const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's: Llama 3's with one digit a word.
pub const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Which expression cuts a piece into words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expression {
    Gpt2,
    /// Llama 3's family: at most `digits` digits a word.
    Llama3 {
        digits: usize,
    },
}

/// How a tokenizer cuts an ASCII piece into words (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Words {
    expression: Expression,
    /// `ByteLevel`'s `add_prefix_space`: a piece that does not start with
    /// a space gets one.
    prefix_space: bool,
}

/// The byte-level alphabet's character for each ASCII byte (GPT-2's
/// `bytes_to_unicode`): printable bytes stand for themselves, the others
/// (controls, space, DEL) for U+0100 onwards in byte order.
const fn byte_chars() -> [char; 128] {
    let mut chars = ['\0'; 128];
    let mut next = 0x100;
    let mut b = 0;
    while b < 128 {
        chars[b] = if b >= 0x21 && b <= 0x7e {
            b as u8 as char
        } else {
            let c = match char::from_u32(next) {
                Some(c) => c,
                None => panic!("U+0100..U+0121 are characters"),
            };
            next += 1;
            c
        };
        b += 1;
    }
    chars
}
const BYTE_CHARS: [char; 128] = byte_chars();

impl Words {
    /// The cut for `tokenizer`, if its normalizer and pre-tokenizer are
    /// ones written out here (module docs).
    pub fn of(tokenizer: &Tokenizer) -> Option<Words> {
        let normalizer = serde_json::to_value(tokenizer.get_normalizer()).ok()?;
        let ascii_unchanged = match &normalizer {
            Value::Null => true,
            n => ["NFC", "NFD", "NFKC", "NFKD"].contains(&n["type"].as_str()?),
        };
        if !ascii_unchanged {
            return None;
        }
        let pre = serde_json::to_value(tokenizer.get_pre_tokenizer()?).ok()?;
        Self::of_pre_tokenizer(&pre)
    }

    fn of_pre_tokenizer(pre: &Value) -> Option<Words> {
        let byte_level =
            |v: &Value, use_regex: bool| v["type"] == "ByteLevel" && v["use_regex"] == use_regex;
        if byte_level(pre, true) {
            return Some(Words {
                expression: Expression::Gpt2,
                prefix_space: pre["add_prefix_space"].as_bool()?,
            });
        }
        let [split, bytes] = pre
            .get("pretokenizers")
            .filter(|_| pre["type"] == "Sequence")?
            .as_array()?
            .as_slice()
        else {
            return None;
        };
        let isolated = json!({"type": "Split", "behavior": "Isolated", "invert": false});
        let same = |key: &str| split.get(key) == isolated.get(key);
        if !(same("type") && same("behavior") && same("invert")) {
            return None;
        }
        // A prefix space after the split would go in front of every word.
        if !byte_level(bytes, false) || bytes["add_prefix_space"] != false {
            return None;
        }
        let expression = match split["pattern"]["Regex"].as_str()? {
            GPT2 => Expression::Gpt2,
            LLAMA3 => Expression::Llama3 { digits: 3 },
            QWEN2 => Expression::Llama3 { digits: 1 },
            _ => return None,
        };
        Some(Words {
            expression,
            prefix_space: false,
        })
    }

    /// `piece`'s ids from `model`, or `None` when the piece is not ASCII
    /// (left to `tokenizers`).
    pub fn encode(&self, model: &impl Model, piece: &str) -> Option<Result<Vec<u32>, String>> {
        let mut ids = Vec::with_capacity(piece.len() / 3);
        let done = self.each_word(piece, |word| {
            let tokens = model.tokenize(word).map_err(|e| e.to_string())?;
            ids.extend(tokens.iter().map(|t| t.id));
            Ok(())
        })?;
        Some(done.map(|()| ids))
    }

    /// Hands each of `piece`'s words to `f`, in the byte-level alphabet;
    /// `None` when the piece is not ASCII.
    fn each_word(
        &self,
        piece: &str,
        mut f: impl FnMut(&str) -> Result<(), String>,
    ) -> Option<Result<(), String>> {
        if !piece.is_ascii() {
            return None;
        }
        let prefixed;
        // (`tokenizers` gives an empty text no prefix space.)
        let piece = if self.prefix_space && !piece.is_empty() && !piece.starts_with(' ') {
            prefixed = format!(" {piece}");
            &prefixed
        } else {
            piece
        };
        let mut word = String::new();
        let mut from = 0;
        while from < piece.len() {
            let to = self.word_end(piece.as_bytes(), from);
            word.clear();
            word.extend(
                piece.as_bytes()[from..to]
                    .iter()
                    .map(|&b| BYTE_CHARS[b as usize]),
            );
            if let Err(e) = f(&word) {
                return Some(Err(e));
            }
            from = to;
        }
        Some(Ok(()))
    }

    /// Where the word that starts at `at` ends: the match the expression's
    /// leftmost-first alternation finds there (every byte is in one of its
    /// classes, so a match starts wherever the last one ended).
    fn word_end(&self, s: &[u8], at: usize) -> usize {
        match self.expression {
            Expression::Gpt2 => gpt2_word_end(s, at),
            Expression::Llama3 { digits } => llama3_word_end(s, at, digits),
        }
    }
}

/// `\s` on ASCII: Unicode's White_Space (tab to carriage return, space).
fn space(b: u8) -> bool {
    matches!(b, b'\t'..=b'\r' | b' ')
}

/// `[^\s\p{L}\p{N}]` on ASCII.
fn other(b: u8) -> bool {
    !space(b) && !b.is_ascii_alphanumeric()
}

/// The end of the run of bytes in `class` from `at`.
fn run(s: &[u8], at: usize, class: impl Fn(u8) -> bool) -> usize {
    at + s[at..].iter().take_while(|&&b| class(b)).count()
}

/// `'s|'t|'re|'ve|'m|'ll|'d` at `at` (an apostrophe): its length.
fn contraction(s: &[u8], at: usize, any_case: bool) -> Option<usize> {
    let rest = &s[at + 1..];
    let lower = |i: usize| {
        rest.get(i)
            .map(|&b| if any_case { b.to_ascii_lowercase() } else { b })
    };
    match (lower(0)?, lower(1)) {
        (b's' | b't' | b'm' | b'd', _) => Some(2),
        (b'r' | b'v', Some(b'e')) | (b'l', Some(b'l')) => Some(3),
        _ => None,
    }
}

/// `\s+(?!\S)|\s+` at `at`, a run of white space: all of it at the end of
/// the text, else all but its last byte (left to lead the next word) when
/// that leaves any.
fn spaces_end(s: &[u8], at: usize) -> usize {
    let end = run(s, at, space);
    if end < s.len() && end - at > 1 {
        end - 1
    } else {
        end
    }
}

/// [`GPT2`]'s word at `at`.
fn gpt2_word_end(s: &[u8], at: usize) -> usize {
    if s[at] == b'\'' {
        if let Some(len) = contraction(s, at, false) {
            return at + len;
        }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: the space is taken
    // with what follows it.
    let first = if s[at] == b' ' && at + 1 < s.len() {
        at + 1
    } else {
        at
    };
    let b = s[first];
    if b.is_ascii_alphabetic() {
        run(s, first, |b| b.is_ascii_alphabetic())
    } else if b.is_ascii_digit() {
        run(s, first, |b| b.is_ascii_digit())
    } else if other(b) {
        run(s, first, other)
    } else {
        spaces_end(s, at)
    }
}

/// [`LLAMA3`]'s (or [`QWEN2`]'s, `digits` 1) word at `at`.
fn llama3_word_end(s: &[u8], at: usize, digits: usize) -> usize {
    let b = s[at];
    let newline = |b: u8| b == b'\r' || b == b'\n';
    if b == b'\'' {
        if let Some(len) = contraction(s, at, true) {
            return at + len;
        }
    }
    // `[^\r\n\p{L}\p{N}]?\p{L}+`
    let next_is_letter = s.get(at + 1).is_some_and(u8::is_ascii_alphabetic);
    if !newline(b) && !b.is_ascii_alphanumeric() && next_is_letter {
        return run(s, at + 1, |b| b.is_ascii_alphabetic());
    }
    if b.is_ascii_alphabetic() {
        return run(s, at, |b| b.is_ascii_alphabetic());
    }
    // `\p{N}{1,digits}`
    if b.is_ascii_digit() {
        return run(s, at, |b| b.is_ascii_digit()).min(at + digits);
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let first = if b == b' ' && s.get(at + 1).is_some_and(|&b| other(b)) {
        at + 1
    } else {
        at
    };
    if other(s[first]) {
        let end = run(s, first, other);
        return run(s, end, newline);
    }
    // `\s*[\r\n]+`: through the run's last line break, where it has one.
    let end = run(s, at, space);
    if let Some(last) = s[at..end].iter().rposition(|&b| newline(b)) {
        return at + last + 1;
    }
    spaces_end(s, at)
}

#[cfg(test)]
mod tests {
    use std::sync::LazyLock;

    use proptest::prelude::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    use super::*;

    /// The golden byte-level tokenizer with `normalizer` and `pre_tokenizer`.
    fn tokenizer_with(normalizer: Value, pre_tokenizer: Value) -> Tokenizer {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/golden/chatml/tokenizer.json");
        let mut file: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        file["normalizer"] = normalizer;
        file["pre_tokenizer"] = pre_tokenizer;
        Tokenizer::from_bytes(serde_json::to_vec(&file).unwrap()).unwrap()
    }

    fn byte_level(prefix_space: bool, use_regex: bool) -> Value {
        json!({"type": "ByteLevel", "add_prefix_space": prefix_space, "trim_offsets": true,
               "use_regex": use_regex})
    }

    fn split_then_bytes(pattern: &str) -> Value {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
             "invert": false},
            byte_level(false, false)]})
    }

    /// Every configuration written out, as its `tokenizer.json` has it.
    fn written_out() -> Vec<(&'static str, Tokenizer)> {
        vec![
            ("gpt2", tokenizer_with(Value::Null, byte_level(false, true))),
            (
                "gpt2, prefix space",
                tokenizer_with(Value::Null, byte_level(true, true)),
            ),
            (
                "gpt2 as a split",
                tokenizer_with(Value::Null, split_then_bytes(GPT2)),
            ),
            (
                "llama 3",
                tokenizer_with(Value::Null, split_then_bytes(LLAMA3)),
            ),
            (
                "qwen2, NFC",
                tokenizer_with(json!({"type": "NFC"}), split_then_bytes(QWEN2)),
            ),
        ]
    }

    #[test]
    fn only_pre_tokenizers_written_out_here_take_this_road() {
        for (name, t) in written_out() {
            assert!(Words::of(&t).is_some(), "{name}");
        }
        let refused = [
            (json!({"type": "Lowercase"}), byte_level(false, true)),
            (Value::Null, byte_level(false, false)),
            (Value::Null, split_then_bytes(r"\s+|\S+")),
            (
                Value::Null,
                json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated",
                 "invert": false},
                byte_level(true, false)]}),
            ),
            (
                Value::Null,
                json!({"type": "Metaspace", "replacement": "▁",
                                 "prepend_scheme": "first", "split": false}),
            ),
        ];
        for (normalizer, pre) in refused {
            let t = tokenizer_with(normalizer.clone(), pre.clone());
            assert_eq!(Words::of(&t), None, "{normalizer} {pre}");
        }
    }

    /// ASCII text heavy in what the expressions tell apart.
    fn ascii_pieces() -> impl Strategy<Value = String> {
        let atoms = prop::sample::select(vec![
            "a", "Zed", "the", "s", "t", "re", "LL", "ve", "M", "d", "'", "'s", "'Re", "7", "42",
            "12345", " ", "  ", "\t", "\n", "\r\n", "\x0b", "\x0c", "\x1f", "\x01", "\x7f", ".",
            "!?", "-", "{\"", "<", "|",
        ]);
        prop::collection::vec(atoms, 0..24).prop_map(|atoms| atoms.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn an_ascii_piece_gets_the_ids_tokenizers_gives(piece in ascii_pieces()) {
            static WRITTEN_OUT: LazyLock<Vec<(&str, Tokenizer)>> = LazyLock::new(written_out);
            for (name, t) in WRITTEN_OUT.iter() {
                let words = Words::of(t).unwrap();
                // The words themselves, which a small vocabulary's ids
                // could hide a difference in.
                let mut cut = Vec::new();
                words.each_word(&piece, |w| { cut.push(w.to_string()); Ok(()) }).unwrap().unwrap();
                let mut theirs = PreTokenizedString::from(piece.as_str());
                t.get_pre_tokenizer().unwrap().pre_tokenize(&mut theirs).unwrap();
                let theirs: Vec<String> = theirs
                    .get_splits(OffsetReferential::Normalized, OffsetType::Byte)
                    .into_iter()
                    .map(|(w, _, _)| w.to_string())
                    .collect();
                prop_assert_eq!(cut, theirs, "{}: {:?}", name, piece);
                let fast = words.encode(t.get_model(), &piece).unwrap().unwrap();
                let want = t.encode_fast(piece.as_str(), false).unwrap().get_ids().to_vec();
                prop_assert_eq!(fast, want, "{}: {:?}", name, piece);
            }
        }
    }

    #[test]
    fn a_piece_past_ascii_is_left_to_tokenizers() {
        let (_, t) = &written_out()[0];
        assert_eq!(Words::of(t).unwrap().encode(t.get_model(), "café"), None);
    }

    #[test]
    fn the_alphabet_is_gpt2s() {
        assert_eq!(BYTE_CHARS[b'!' as usize], '!');
        assert_eq!(BYTE_CHARS[b' ' as usize], '\u{120}');
        assert_eq!(BYTE_CHARS[b'\n' as usize], '\u{10a}');
        assert_eq!(BYTE_CHARS[0x7f], '\u{121}');
    }

    fn cut(words: Expression, s: &str) -> Vec<&str> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < s.len() {
            let end = match words {
                Expression::Gpt2 => gpt2_word_end(s.as_bytes(), at),
                Expression::Llama3 { digits } => llama3_word_end(s.as_bytes(), at, digits),
            };
            out.push(&s[at..end]);
            at = end;
        }
        out
    }

    #[test]
    fn white_space_before_a_word_leaves_it_one_space() {
        assert_eq!(
            cut(Expression::Gpt2, "a   b'sT\n\n!?"),
            ["a", "  ", " b", "'s", "T", "\n", "\n", "!?"]
        );
        let llama = Expression::Llama3 { digits: 3 };
        assert_eq!(
            cut(llama, "He'LL pay 12345.\n\n  x\t!"),
            ["He", "'LL", " pay", " ", "123", "45", ".\n\n", " ", " x", "\t", "!"]
        );
    }
}
