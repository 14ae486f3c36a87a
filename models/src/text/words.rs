//! Byte-level BPE at corpus speed: each distinct pre-token encoded by the `tokenizers`
//! crate's model once ([`Words`]), the pre-tokens cut by hand ([`pre_tokens`]).
//!
//! # Note: why the ids are the crate's
//! With no normalizer and no added token in the text, a tokenizer whose pre-tokenizer is
//! the byte-level one alone (its pattern on, no prefix space) encodes a text thus: the
//! pattern cuts it into pre-tokens ([`pre_tokens`] matches it), each is mapped to the byte
//! alphabet ([`byte_chars`]), and the model encodes each alone (the same way every time,
//! BPE dropout aside); without special tokens added, post-processing keeps the ids. So a
//! text's ids are its pre-tokens' ids one after another, and a pre-token's ids are the
//! model's for its mapped bytes. Pre-tokens of up to [`CACHED_PIECE`] bytes are cached.

use std::sync::Mutex;

use rustc_hash::FxHashMap;

use tokenizers::Model;

use super::pattern::{Classes, pre_tokens};

/// Distinct pieces a cache shard keeps (then it stops adding: a corpus's frequent words
/// come early). About 20 MB.
const CACHE_ENTRIES: usize = 1 << 18;
/// Longest pre-token cached, in bytes (longer ones rarely recur).
const CACHED_PIECE: usize = 64;

type Cache = FxHashMap<Box<str>, Box<[u32]>>;

/// What one thread keeps: the pieces' ids and the characters' classes it has seen.
struct Shard {
    pieces: Cache,
    classes: Classes,
}

/// The pieces' ids seen so far, one shard per thread of rayon's pool (and one for any
/// other thread), for a tokenizer [`Words::of`] accepts.
pub(super) struct Words {
    added: Vec<String>,
    bytes: [char; 256],
    shards: Vec<Mutex<Shard>>,
}

impl Words {
    /// The cache, if `tokenizer` encodes as the module note says: no normalizer, the
    /// byte-level pre-tokenizer alone with its pattern and no prefix space, no BPE dropout,
    /// no added token holding a space, no truncation or padding. Any post-processor will
    /// do: the crate's add tokens only when asked for special ones (a template's, BERT's
    /// and RoBERTa's check; the byte-level one moves offsets), which these ids never are.
    pub fn of(tokenizer: &tokenizers::Tokenizer) -> Option<Self> {
        use tokenizers::{ModelWrapper, PreTokenizerWrapper};
        let byte_level = matches!(
            tokenizer.get_pre_tokenizer(),
            Some(PreTokenizerWrapper::ByteLevel(b)) if b.use_regex && !b.add_prefix_space
        );
        let random = matches!(tokenizer.get_model(), ModelWrapper::BPE(bpe) if bpe.dropout.is_some_and(|p| p > 0.0));
        let shaped = tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some();
        let added: Vec<String> = tokenizer.get_added_tokens_decoder().values().map(|t| t.content.clone()).collect();
        let spaced = added.iter().any(|t| t.contains(char::is_whitespace) || t.is_empty());
        if !byte_level || random || shaped || spaced || tokenizer.get_normalizer().is_some() {
            return None;
        }
        let shards = (0..=rayon::current_num_threads())
            .map(|_| Some(Mutex::new(Shard { pieces: Cache::default(), classes: Classes::new()? })))
            .collect::<Option<_>>()?;
        Some(Self { added, bytes: byte_chars(), shards })
    }

    /// The ids of `text` as `tokenizer` (the one [`of`](Self::of) accepted) gives them:
    /// each pre-token's from the cache, else from the model; a text holding an added token
    /// through the whole pipeline.
    pub fn encode(&self, tokenizer: &tokenizers::Tokenizer, text: &str) -> tokenizers::Result<Vec<u32>> {
        if self.added.iter().any(|t| text.contains(t.as_str())) {
            return tokenizer.encode_fast(text, false).map(|e| e.get_ids().to_vec());
        }
        // This thread's shard, held for the whole text: nothing below runs rayon work (the
        // crate's encode of one text does not), so no task this thread might pick up while
        // waiting can ask for the shard again.
        let index = rayon::current_thread_index().map_or(self.shards.len() - 1, |i| i % (self.shards.len() - 1));
        let mut shard = self.shards[index].lock().unwrap_or_else(|p| p.into_inner());
        let Shard { pieces, classes } = &mut *shard;
        let model = |piece: &str| -> tokenizers::Result<Vec<u32>> {
            let mapped: String = piece.bytes().map(|b| self.bytes[usize::from(b)]).collect();
            Ok(tokenizer.get_model().tokenize(&mapped)?.into_iter().map(|t| t.id).collect())
        };
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut failed: tokenizers::Result<()> = Ok(());
        pre_tokens(text, classes, |range| {
            if failed.is_err() {
                return;
            }
            let piece = &text[range];
            if let Some(known) = pieces.get(piece) {
                ids.extend_from_slice(known);
                return;
            }
            match model(piece) {
                Ok(new) => {
                    ids.extend_from_slice(&new);
                    if pieces.len() < CACHE_ENTRIES && piece.len() <= CACHED_PIECE {
                        pieces.insert(piece.into(), new.into());
                    }
                }
                Err(e) => failed = Err(e),
            }
        });
        failed.map(|()| ids)
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

#[cfg(test)]
mod tests {
    use super::super::pattern::tests::random_text;
    use super::*;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::tokenizer::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    /// What `zerotrain tokenize --train-vocab` trains, on a little text.
    fn trained() -> tokenizers::Tokenizer {
        let text = ["the cat sat on the mat; the dog's bowl, 42 bones", "déjà vu — naïve café, 東京 “quoted”"];
        super::super::train_byte_level_bpe(text.iter(), 400).unwrap()
    }

    /// Through the cache, texts encode to the crate's ids: ASCII, accented and other
    /// scripts, curly quotes, no-break spaces, an added token, runs of whitespace; with a
    /// post-processor that puts a token before every text, which adds nothing here.
    #[test]
    fn ids_are_the_crates() {
        let mut tokenizer = trained();
        let bos = tokenizer.token_to_id("<|endoftext|>").unwrap();
        let template = tokenizers::processors::template::TemplateProcessing::builder()
            .try_single("<|endoftext|> $A")
            .unwrap()
            .special_tokens(vec![("<|endoftext|>", bos)])
            .build()
            .unwrap();
        tokenizer.with_post_processor(Some(template));
        assert_eq!(tokenizer.encode_fast("the", true).unwrap().get_ids()[0], bos, "the template is on");
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
            let text = random_text(&mut state, &alphabet, len % 30);
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
