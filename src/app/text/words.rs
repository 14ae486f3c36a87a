//! Byte-level BPE at corpus speed: GPT-2's pre-tokenizing pattern matched by hand on ASCII
//! text, and each distinct pre-token encoded by the `tokenizers` crate's model once
//! ([`Words`]).
//!
//! # Note: why the ids are the crate's
//! With no normalizer and no added token in the text, a tokenizer whose pre-tokenizer is
//! the byte-level one alone (its pattern on, no prefix space) encodes a text thus: the
//! pattern `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
//! cuts it into pre-tokens, each is mapped to the byte alphabet ([`byte_chars`]), and the
//! model encodes each alone (the same way every time, BPE dropout aside); without special
//! tokens added, post-processing keeps the ids. So a text's ids are its pre-tokens' ids one
//! after another, and a pre-token's ids are the model's for its mapped bytes. On ASCII the
//! pattern's classes are bytes (`\p{L}`: A-Z a-z; `\p{N}`: 0-9; `\s`: tab, newline,
//! vertical tab, form feed, carriage return, space), which [`pre_tokens`] matches
//! alternative by alternative as the pattern does. Text that is not ASCII is matched with
//! the pattern itself (the crate's regex engine) a segment at a time, cut before a space
//! between two non-spaces, where no pre-token crosses (the note on
//! [`Tokenizer::encode_long`](super::Tokenizer::encode_long)). Pre-tokens of up to
//! [`CACHED_PIECE`] bytes are cached.

use std::sync::Mutex;

use rustc_hash::FxHashMap;

use tokenizers::Model;

/// The byte-level pre-tokenizer's pattern (the module note).
const PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Distinct pieces a cache shard keeps (then it stops adding: a corpus's frequent words
/// come early). About 20 MB.
const CACHE_ENTRIES: usize = 1 << 18;
/// Longest pre-token cached, in bytes (longer ones rarely recur).
const CACHED_PIECE: usize = 64;

type Cache = FxHashMap<Box<str>, Box<[u32]>>;

/// The pieces' ids seen so far, one cache per thread of rayon's pool (and one for any
/// other thread), for a tokenizer [`Words::of`] accepts.
pub(super) struct Words {
    added: Vec<String>,
    bytes: [char; 256],
    /// The pattern, for text that is not ASCII (the crate's regex engine, so its matches).
    pattern: tokenizers::utils::SysRegex,
    caches: Vec<Mutex<Cache>>,
}

impl Words {
    /// The cache, if `tokenizer` encodes as the module note says: no normalizer, the
    /// byte-level pre-tokenizer alone with its pattern and no prefix space, no BPE dropout,
    /// no added token holding a space, a post-processor that adds nothing without special
    /// tokens (none, or the byte-level one), no truncation or padding.
    pub fn of(tokenizer: &tokenizers::Tokenizer) -> Option<Self> {
        use tokenizers::{ModelWrapper, PostProcessorWrapper, PreTokenizerWrapper};
        let byte_level = matches!(
            tokenizer.get_pre_tokenizer(),
            Some(PreTokenizerWrapper::ByteLevel(b)) if b.use_regex && !b.add_prefix_space
        );
        let random = matches!(tokenizer.get_model(), ModelWrapper::BPE(bpe) if bpe.dropout.is_some_and(|p| p > 0.0));
        let post = matches!(tokenizer.get_post_processor(), None | Some(PostProcessorWrapper::ByteLevel(_)));
        let shaped = tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some();
        let added: Vec<String> = tokenizer.get_added_tokens_decoder().values().map(|t| t.content.clone()).collect();
        let spaced = added.iter().any(|t| t.contains(char::is_whitespace) || t.is_empty());
        if !byte_level || random || !post || shaped || spaced || tokenizer.get_normalizer().is_some() {
            return None;
        }
        let pattern = tokenizers::utils::SysRegex::new(PATTERN).ok()?;
        let caches = (0..=rayon::current_num_threads()).map(|_| Mutex::new(Cache::default())).collect();
        Some(Self { added, bytes: byte_chars(), pattern, caches })
    }

    /// The ids of `text` as `tokenizer` (the one [`of`](Self::of) accepted) gives them:
    /// each pre-token's from the cache, else from the model; a text holding an added token
    /// through the whole pipeline.
    pub fn encode(&self, tokenizer: &tokenizers::Tokenizer, text: &str) -> tokenizers::Result<Vec<u32>> {
        let whole = |text: &str| tokenizer.encode_fast(text, false).map(|e| e.get_ids().to_vec());
        if self.added.iter().any(|t| text.contains(t.as_str())) {
            return whole(text);
        }
        // This thread's shard, held for the whole text: nothing below runs rayon work (the
        // crate's encode of one text does not), so no task this thread might pick up while
        // waiting can ask for the shard again.
        let shard = rayon::current_thread_index().map_or(self.caches.len() - 1, |i| i % (self.caches.len() - 1));
        let mut cache = self.caches[shard].lock().unwrap_or_else(|p| p.into_inner());
        let model = |piece: &str| -> tokenizers::Result<Vec<u32>> {
            let mapped: String = piece.bytes().map(|b| self.bytes[usize::from(b)]).collect();
            Ok(tokenizer.get_model().tokenize(&mapped)?.into_iter().map(|t| t.id).collect())
        };
        // A pre-token's ids, from the cache or the model.
        let mut cached = |piece: &str, ids: &mut Vec<u32>| -> tokenizers::Result<()> {
            if let Some(known) = cache.get(piece) {
                ids.extend_from_slice(known);
                return Ok(());
            }
            let new = model(piece)?;
            ids.extend_from_slice(&new);
            if cache.len() < CACHE_ENTRIES && piece.len() <= CACHED_PIECE {
                cache.insert(piece.into(), new.into());
            }
            Ok(())
        };
        let bytes = text.as_bytes();
        let (mut ids, mut at) = (Vec::with_capacity(text.len() / 3), 0);
        while at < bytes.len() {
            let wide = bytes[at..].iter().position(|b| !b.is_ascii()).map(|k| at + k);
            // The ASCII before a wide character, up to the last cut before it.
            let end = wide.map_or(bytes.len(), |k| (at + 1..k).rev().find(|&i| is_cut(text, i)).unwrap_or(at));
            let mut failed: tokenizers::Result<()> = Ok(());
            pre_tokens(&bytes[at..end], |piece| {
                if failed.is_ok() {
                    failed = cached(&text[at + piece.start..at + piece.end], &mut ids);
                }
            });
            failed?;
            let Some(wide) = wide else { break };
            let next = (wide + 1..bytes.len()).find(|&i| is_cut(text, i)).unwrap_or(bytes.len());
            let segment = &text[end..next];
            // Pre-tokens are the matches and whatever lies between (none: every character
            // starts one of the alternatives).
            let mut from = 0;
            for (start, stop) in self.pattern.find_iter(segment).chain([(segment.len(), segment.len())]) {
                for piece in [&segment[from..start], &segment[start..stop]] {
                    if !piece.is_empty() {
                        cached(piece, &mut ids)?;
                    }
                }
                from = stop;
            }
            at = next;
        }
        Ok(ids)
    }
}

/// The byte-level alphabet: the character each byte stands for (GPT-2's table: printable
/// Latin-1 bytes as themselves, the others from U+0100 on, in byte order).
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next = 0x100;
    for (b, c) in chars.iter_mut().enumerate() {
        let byte = b as u8;
        *c = if matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
            char::from(byte)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below U+0200")
        };
    }
    chars
}

/// Whether byte `i` of `text` is a space between two characters that are not whitespace
/// (Unicode's, as the pattern's `\s`): no pre-token crosses it.
pub(super) fn is_cut(text: &str, i: usize) -> bool {
    text.as_bytes()[i] == b' '
        && text[..i].chars().next_back().is_some_and(|c| !c.is_whitespace())
        && text[i + 1..].chars().next().is_some_and(|c| !c.is_whitespace())
}

/// The byte classes of the pattern on ASCII.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Other,
}

fn class(b: u8) -> Class {
    match b {
        b'A'..=b'Z' | b'a'..=b'z' => Class::Letter,
        b'0'..=b'9' => Class::Digit,
        b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ' => Class::Space,
        _ => Class::Other,
    }
}

/// Calls `piece` with the byte range of each match of the byte-level pattern on ASCII
/// `text`, in order (the module note).
pub(super) fn pre_tokens(text: &[u8], mut piece: impl FnMut(std::ops::Range<usize>)) {
    let n = text.len();
    let run = |from: usize, of: Class| (from..n).find(|&j| class(text[j]) != of).unwrap_or(n);
    let mut i = 0;
    while i < n {
        // 's 't 're 've 'm 'll 'd
        if text[i] == b'\'' {
            let rest = &text[i + 1..];
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
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: a space joins the run after it.
        let lead = usize::from(text[i] == b' ' && i + 1 < n && class(text[i + 1]) != Class::Space);
        let first = class(text[i + lead]);
        if first != Class::Space {
            let end = run(i + lead, first);
            piece(i..end);
            i = end;
            continue;
        }
        // `\s+(?!\S)`, else `\s+`: a run of whitespace gives its last character to what
        // follows it, unless the run is one character or ends the text.
        let end = run(i, Class::Space);
        let end = if end < n && end - i > 1 { end - 1 } else { end };
        piece(i..end);
        i = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::tokenizer::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    /// The crate's own byte-level pre-tokenizer, as byte ranges.
    fn crates(text: &str) -> Vec<std::ops::Range<usize>> {
        let mut pre = PreTokenizedString::from(text);
        ByteLevel::new(false, true, true).pre_tokenize(&mut pre).unwrap();
        pre.get_splits(OffsetReferential::Original, OffsetType::Byte).into_iter().map(|(_, o, _)| o.0..o.1).collect()
    }

    fn mine(text: &str) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        pre_tokens(text.as_bytes(), |r| out.push(r));
        out
    }

    /// The hand-written matcher cuts ASCII exactly where the crate's pattern does: on the
    /// cases each alternative has, and on random strings over the classes' edges.
    #[test]
    fn pre_tokens_match_the_crates_pattern_on_ascii() {
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
        ];
        for text in cases {
            assert_eq!(mine(text), crates(text), "{text:?}");
        }
        let alphabet = b"aZ09 '\t\n\r\x0b\x0c.!-_\"sdmltvre\x01";
        let mut state = 0x2545_f491_u64;
        for len in 0..400 {
            let text: String = (0..len % 40)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    alphabet[(state >> 33) as usize % alphabet.len()] as char
                })
                .collect();
            assert_eq!(mine(&text), crates(&text), "{text:?}");
        }
    }

    /// What `zerotrain tokenize --train-vocab` trains, on a little text.
    fn trained() -> tokenizers::Tokenizer {
        let text = ["the cat sat on the mat; the dog's bowl, 42 bones", "déjà vu — naïve café, 東京 “quoted”"];
        super::super::train_byte_level_bpe(&text, 400).unwrap()
    }

    /// Through the cache, texts encode to the crate's ids: ASCII, accented and other
    /// scripts, curly quotes, no-break spaces, an added token, runs of whitespace.
    #[test]
    fn ids_are_the_crates() {
        let tokenizer = trained();
        let words = Words::of(&tokenizer).expect("a byte-level BPE");
        let crate_ids = |t: &str| tokenizer.encode_fast(t, false).map(|e| e.get_ids().to_vec());
        let texts = [
            "the cat sat on the mat",
            "déjà vu: the naïve café's menu, 42 bones",
            "東京 and “quoted” words\u{a0}with a no-break space and \u{2003}em space",
            "before<|endoftext|>after the token",
            "  spaces\n\n and\ttabs \u{a0} \né\n",
            "é",
            "the dog's bowl 東京東京 the the the",
            "",
        ];
        for text in texts {
            for _ in 0..2 {
                // Twice: the second time from the cache.
                assert_eq!(words.encode(&tokenizer, text).unwrap(), crate_ids(text).unwrap(), "{text:?}");
            }
        }
        // Random strings over the classes' edges: letters with combining accents, number
        // letters and superscripts, Unicode spaces next to ASCII ones, apostrophes.
        let alphabet: Vec<char> = "aZ9 '\t\n.s東é\u{301}\u{a0}\u{2003}Ⅻ²🙂“—ſ\u{85}".chars().collect();
        let mut state = 0x853c_49e6_748f_ea9b_u64;
        for len in 0..300 {
            let text: String = (0..len % 30)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    alphabet[(state >> 33) as usize % alphabet.len()]
                })
                .collect();
            assert_eq!(words.encode(&tokenizer, &text).unwrap(), crate_ids(&text).unwrap(), "{text:?}");
        }
    }

    /// The byte alphabet is the crate's: every byte of every text maps to the characters
    /// its pre-tokenizer gives.
    #[test]
    fn the_byte_alphabet_is_the_crates() {
        let chars = byte_chars();
        let all: Vec<u8> = (0..=255).collect();
        let texts = [String::from_utf8_lossy(&all[..128]).into_owned(), "é東€\u{a0}\u{ad}ÿ🙂".into()];
        for text in texts {
            let mut pre = PreTokenizedString::from(text.as_str());
            ByteLevel::new(false, true, true).pre_tokenize(&mut pre).unwrap();
            let crate_mapped: String = pre
                .get_splits(OffsetReferential::Original, OffsetType::Byte)
                .into_iter()
                .map(|(s, _, _)| s.to_string())
                .collect();
            let mine: String = text.bytes().map(|b| chars[usize::from(b)]).collect();
            assert_eq!(mine, crate_mapped, "{text:?}");
        }
        assert_eq!(chars[usize::from(b' ')], 'Ġ');
    }

    /// A tokenizer the note does not cover gets no cache: a prefix space, a normalizer.
    #[test]
    fn other_tokenizers_are_left_to_the_crate() {
        let mut tokenizer = trained();
        assert!(Words::of(&tokenizer).is_some());
        let prefixed = ByteLevel::new(true, true, true);
        tokenizer.with_pre_tokenizer(Some(tokenizers::PreTokenizerWrapper::ByteLevel(prefixed)));
        assert!(Words::of(&tokenizer).is_none());
        let mut tokenizer = trained();
        tokenizer.with_normalizer(Some(tokenizers::normalizers::Lowercase));
        assert!(Words::of(&tokenizer).is_none());
    }
}
