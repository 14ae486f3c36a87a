//! GPT-2's byte-level pre-tokenizing pattern,
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, matched by
//! hand ([`pre_tokens`]).
//!
//! # Note: the classes are the regex engine's
//! [`pre_tokens`] matches the pattern alternative by alternative as the regex engine does
//! (leftmost first), over four classes of characters: letters (`\p{L}`), numbers
//! (`\p{N}`), whitespace (`\s`) and the rest. A character's class is asked of the
//! `tokenizers` crate's own regex engine with those three classes, once per character a
//! thread meets ([`Classes`]), so the classes are the engine's, whatever Unicode version it
//! carries.

use std::ops::Range;

use rustc_hash::FxHashMap;

use tokenizers::utils::SysRegex;

/// Whether byte `i` of `text` is a space between two characters that are not whitespace
/// (Unicode's, as the pattern's `\s`): no pre-token crosses it.
pub(super) fn is_cut(text: &str, i: usize) -> bool {
    text.as_bytes()[i] == b' '
        && text[..i].chars().next_back().is_some_and(|c| !c.is_whitespace())
        && text[i + 1..].chars().next().is_some_and(|c| !c.is_whitespace())
}

/// The pattern's classes of characters.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Class {
    Letter,
    Number,
    Space,
    Other,
}

/// Each character's [`Class`] as the crate's regex engine sees it, asked once per character:
/// a table over the Basic Multilingual Plane (ASCII filled at once) and a map beyond it.
pub(super) struct Classes {
    letter: SysRegex,
    number: SysRegex,
    space: SysRegex,
    ascii: [Class; 128],
    plane: Vec<Option<Class>>,
    beyond: FxHashMap<char, Class>,
}

impl Classes {
    /// The three classes compiled by the crate's engine, ASCII's classes asked.
    pub fn new() -> Option<Self> {
        let compile = |class: &str| SysRegex::new(class).ok();
        let mut classes = Self {
            letter: compile(r"\p{L}")?,
            number: compile(r"\p{N}")?,
            space: compile(r"\s")?,
            ascii: [Class::Other; 128],
            plane: vec![None; 0x1_0000],
            beyond: FxHashMap::default(),
        };
        for b in 0..0x80u8 {
            classes.ascii[usize::from(b)] = classes.ask(char::from(b));
            classes.plane[usize::from(b)] = Some(classes.ascii[usize::from(b)]);
        }
        Some(classes)
    }

    fn ask(&self, c: char) -> Class {
        let mut buf = [0; 4];
        let one = &*c.encode_utf8(&mut buf);
        let is = |class: &SysRegex| class.find_iter(one).next().is_some();
        if is(&self.letter) {
            Class::Letter
        } else if is(&self.number) {
            Class::Number
        } else if is(&self.space) {
            Class::Space
        } else {
            Class::Other
        }
    }

    /// The class of `c`.
    pub fn of(&mut self, c: char) -> Class {
        match self.plane.get(c as usize) {
            Some(Some(known)) => *known,
            Some(None) => {
                let class = self.ask(c);
                self.plane[c as usize] = Some(class);
                class
            }
            None => match self.beyond.get(&c) {
                Some(known) => *known,
                None => {
                    let class = self.ask(c);
                    self.beyond.insert(c, class);
                    class
                }
            },
        }
    }
}

/// The character that starts at byte `i` of `text`, and its length in bytes.
#[inline(always)]
fn char_at(text: &str, i: usize) -> (char, usize) {
    let b = text.as_bytes()[i];
    if b.is_ascii() {
        return (char::from(b), 1);
    }
    let c = text[i..].chars().next().expect("i is a character boundary");
    (c, c.len_utf8())
}

/// The class of the character that starts at byte `i` of `text`, and its length in bytes.
#[inline(always)]
fn class_at(text: &str, classes: &mut Classes, i: usize) -> (Class, usize) {
    let b = text.as_bytes()[i];
    if b.is_ascii() {
        return (classes.ascii[usize::from(b)], 1);
    }
    let (c, len) = char_at(text, i);
    (classes.of(c), len)
}

/// The end of the run of characters of class `of` from byte `from` of `text`, and the
/// start of its last character.
fn run(text: &str, classes: &mut Classes, from: usize, of: Class) -> (usize, usize) {
    let (mut end, mut last) = (from, from);
    while end < text.len() {
        let (class, len) = class_at(text, classes, end);
        if class != of {
            break;
        }
        (last, end) = (end, end + len);
    }
    (end, last)
}

/// Calls `piece` with the byte range of each match of the byte-level pattern on `text`, in
/// order (the module note).
pub(super) fn pre_tokens(text: &str, classes: &mut Classes, mut piece: impl FnMut(Range<usize>)) {
    let (bytes, n) = (text.as_bytes(), text.len());
    let mut i = 0;
    while i < n {
        // 's 't 're 've 'm 'll 'd
        if bytes[i] == b'\'' {
            let rest = &bytes[i + 1..];
            let len = if rest.starts_with(b"re") || rest.starts_with(b"ve") || rest.starts_with(b"ll") {
                3
            } else if rest.first().is_some_and(|b| matches!(b, b's' | b't' | b'm' | b'd')) {
                2
            } else {
                0
            };
            if len > 0 {
                piece(i..i + len);
                i += len;
                continue;
            }
        }
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: a space (U+0020 only) joins the run
        // after it.
        let (mut first, len) = class_at(text, classes, i);
        let mut from = i;
        if bytes[i] == b' ' && i + 1 < n {
            let next = class_at(text, classes, i + 1).0;
            if next != Class::Space {
                (first, from) = (next, i + 1);
            }
        }
        if first != Class::Space {
            let (end, _) = run(text, classes, from, first);
            piece(i..end);
            i = end;
            continue;
        }
        // `\s+(?!\S)`, else `\s+`: a run of whitespace gives its last character to what
        // follows it, unless the run is one character or ends the text.
        let (end, last) = run(text, classes, i, Class::Space);
        let end = if end < n && last > i { last } else { end };
        debug_assert!(end >= i + len);
        piece(i..end);
        i = end;
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::tokenizer::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    /// The crate's own byte-level pre-tokenizer, as byte ranges.
    fn crates(text: &str) -> Vec<std::ops::Range<usize>> {
        let mut pre = PreTokenizedString::from(text);
        ByteLevel::new(false, true, true).pre_tokenize(&mut pre).unwrap();
        pre.get_splits(OffsetReferential::Original, OffsetType::Byte).into_iter().map(|(_, o, _)| o.0..o.1).collect()
    }

    fn mine(classes: &mut Classes, text: &str) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        pre_tokens(text, classes, |r| out.push(r));
        out
    }

    /// `len` characters drawn from `alphabet` by a fixed generator.
    pub(in crate::text) fn random_text(state: &mut u64, alphabet: &[char], len: usize) -> String {
        (0..len)
            .map(|_| {
                *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                alphabet[(*state >> 33) as usize % alphabet.len()]
            })
            .collect()
    }

    /// The hand-written matcher cuts text exactly where the crate's pattern does: on the
    /// cases each alternative has, and on random strings over the classes' edges, ASCII and
    /// not.
    #[test]
    fn pre_tokens_match_the_crates_pattern() {
        let mut classes = Classes::new().unwrap();
        let cases = [
            "",
            "a",
            " ",
            "Hello world",
            "  two spaces  before and after  ",
            "tabs\tand\nnew\n\nlines\r\n end\n",
            "don't we'll they're I've I'm he'd it's 'tis 'S ''s",
            "x'",
            "'",
            "?'s",
            "numbers 123 4.5e6 and 7,000",
            "a1b2 c3",
            "punct!!! ...and (brackets) [x]{y} \"quotes\" @#$%^&*",
            " \x0b\x0c mixed \x00 control \x7f bytes",
            "ends with spaces   ",
            "\n\n\nleading newlines",
            "déjà vu — naïve café, 東京 “quoted” ١٢٣ Ⅻ² e\u{301}",
            "no-break\u{a0}space\u{a0}\u{a0} and\u{2003}\u{2003}em \u{3000}ideographic\u{85}",
            "\u{a0}x \u{a0}\u{a0}y \u{a0}",
            "emoji 🙂🙂 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 letters 𝟙𝟚",
        ];
        for text in cases {
            assert_eq!(mine(&mut classes, text), crates(text), "{text:?}");
        }
        let ascii: Vec<char> = "aZ09 '\t\n\r\x0b\x0c.!-_\"sdmltvre\x01".chars().collect();
        let wide: Vec<char> = "aZ9 's\n.é\u{301}東\u{a0}\u{2003}\u{3000}Ⅻ²١🙂𝔘𝟙“—ſ\u{85}\u{2028}".chars().collect();
        let mut state = 0x2545_f491_u64;
        for (alphabet, count) in [(&ascii, 400), (&wide, 1000)] {
            for len in 0..count {
                let text = random_text(&mut state, alphabet, len % 40);
                assert_eq!(mine(&mut classes, &text), crates(&text), "{text:?}");
            }
        }
    }

    /// Classes are the regex engine's: letters of several scripts, numbers of several
    /// kinds, Unicode's spaces, marks and symbols.
    #[test]
    fn classes_are_the_engines() {
        let mut classes = Classes::new().unwrap();
        for (chars, class) in [
            ("aZéſ東Дאλǅʰ𝔘", Class::Letter),
            ("09²١Ⅻ½𝟙", Class::Number),
            (" \t\n\r\x0b\x0c\u{85}\u{a0}\u{2003}\u{2028}\u{3000}", Class::Space),
            ("'.!\u{301}“—🙂\x00\u{ad}\u{200b}", Class::Other),
        ] {
            for c in chars.chars() {
                assert_eq!(classes.of(c), class, "{c:?}");
                assert_eq!(classes.of(c), class, "{c:?}, asked again");
            }
        }
    }
}
