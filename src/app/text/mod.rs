//! Text for the Hugging Face families: a `tokenizer.json` through Hugging Face's own
//! `tokenizers` crate ([`Tokenizer`]), corpora tokenized once into memory-mapped token
//! files ([`tokens`]), and the order a run reads their windows in ([`sampler`]).

mod pattern;
pub mod sampler;
pub mod tokens;
mod words;

use std::path::{Path, PathBuf};

use self::words::Words;
use crate::app::file_error::FileError;

/// A `tokenizer.json`: text to token ids and back, exactly as Hugging Face's tokenizers do
/// (same crate), special tokens not added.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    file: PathBuf,
    /// Whether a text may be cut before any space that follows a non-space and precedes
    /// one, and encoded piece by piece (see [`Tokenizer::encode_long`]).
    splits_at_spaces: bool,
    /// A GPT-2-style byte-level BPE's pre-tokens, each encoded once (`words.rs`).
    words: Option<Words>,
}

/// Pieces [`Tokenizer::encode_long`] cuts a long text into, in bytes at least.
const PIECE_BYTES: usize = 1 << 16;

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({}, {} tokens)", self.file.display(), self.vocab_size())
    }
}

impl Tokenizer {
    /// Reads `path`.
    pub fn from_file(path: &Path) -> Result<Self, FileError> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| FileError::new(path, format!("not a usable tokenizer.json: {e}")))?;
        let splits_at_spaces = splits_at_spaces(&inner);
        let words = Words::of(&inner);
        Ok(Self { inner, file: path.to_path_buf(), splits_at_spaces, words })
    }

    /// The file it was read from.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Token ids of `text` (a GPT-2-style byte-level BPE's through a cache of the words
    /// it has seen, the same ids: `words.rs`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, FileError> {
        let ids = match &self.words {
            Some(words) => words.encode(&self.inner, text),
            None => self.inner.encode_fast(text, false).map(|e| e.get_ids().to_vec()),
        };
        ids.map_err(|e| self.error(format!("cannot encode: {e}")))
    }

    /// Token ids of `text`, the same as [`encode`](Self::encode)'s, a long text encoded in
    /// pieces on every core where the tokenizer allows it.
    ///
    /// # Note: where a text may be cut
    /// GPT-2's byte-level pre-tokenizer splits text with a pattern none of whose matches
    /// holds a non-space followed by a space (a word takes at most one space, in front;
    /// runs of whitespace start with whitespace). So with that pre-tokenizer alone (no
    /// normalizer, no added token containing a space), every space that follows a
    /// non-space starts a new pre-token, and the BPE model encodes pre-tokens one by one:
    /// cutting the text there and concatenating the pieces' ids gives the whole text's ids.
    /// Other tokenizers (a normalizer, a Metaspace prefix added to each text) encode the
    /// text whole.
    pub fn encode_long(&self, text: &str) -> Result<Vec<u32>, FileError> {
        use rayon::prelude::*;
        if !self.splits_at_spaces || text.len() < 2 * PIECE_BYTES {
            return self.encode(text);
        }
        let pieces = cut_at_spaces(text, PIECE_BYTES);
        let ids: Vec<Vec<u32>> = pieces.par_iter().map(|p| self.encode(p)).collect::<Result<_, _>>()?;
        Ok(ids.concat())
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, FileError> {
        self.inner.decode(ids, false).map_err(|e| self.error(format!("cannot decode: {e}")))
    }

    /// Its vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The end-of-text token that closes each document of a token file: the first of the
    /// usual names the tokenizer has, else its last id.
    pub fn end_of_text(&self) -> u32 {
        ["<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>"]
            .iter()
            .find_map(|t| self.token_id(t))
            .unwrap_or(self.vocab_size().saturating_sub(1) as u32)
    }

    /// The id of `token` (an end-of-text token such as `<|endoftext|>`), if it has one.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn error(&self, message: String) -> FileError {
        FileError::new(&self.file, message)
    }
}

/// A byte-level BPE as GPT-2's (its pre-tokenizer and decoder, no prefix space) trained
/// on `documents` to `vocab` tokens, `<|endoftext|>` among them (`tokenize --train-vocab`).
pub fn train_byte_level_bpe<S: AsRef<str> + Send + Sync>(
    documents: &[S],
    vocab: usize,
) -> tokenizers::Result<tokenizers::Tokenizer> {
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper};
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab)
        .min_frequency(0)
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true))));
    tokenizer.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
    tokenizer.train(&mut trainer, documents.iter().map(AsRef::as_ref))?;
    Ok(tokenizer)
}

/// Whether `tokenizer` pre-tokenizes with GPT-2's byte-level pattern alone (see
/// [`Tokenizer::encode_long`]).
fn splits_at_spaces(tokenizer: &tokenizers::Tokenizer) -> bool {
    let byte_level = matches!(
        tokenizer.get_pre_tokenizer(),
        Some(tokenizers::PreTokenizerWrapper::ByteLevel(b)) if b.use_regex
    );
    let spaced_token = tokenizer.get_added_tokens_decoder().values().any(|t| t.content.contains(char::is_whitespace));
    byte_level && tokenizer.get_normalizer().is_none() && !spaced_token
}

/// `text` cut into pieces of at least `bytes` (the last may be shorter), each cut before a
/// space whose neighbours are not whitespace (Unicode's, as the pattern's `\s`).
fn cut_at_spaces(text: &str, bytes: usize) -> Vec<&str> {
    let b = text.as_bytes();
    let cuttable = |i: usize| pattern::is_cut(text, i);
    let (mut pieces, mut start, mut at) = (Vec::new(), 0, bytes);
    while at < b.len() {
        match (at..b.len()).find(|&i| cuttable(i)) {
            Some(cut) => {
                pieces.push(&text[start..cut]);
                start = cut;
                at = cut + bytes;
            }
            None => break,
        }
    }
    pieces.push(&text[start..]);
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_before_spaces_between_non_spaces() {
        let text = "ab cd  ef\u{a0} gh\n ij kl";
        let pieces = cut_at_spaces(text, 1);
        assert_eq!(pieces.concat(), text);
        assert_eq!(pieces, ["ab", " cd  ef\u{a0} gh\n ij", " kl"]);
        assert_eq!(cut_at_spaces("abc", 1), ["abc"]);
    }
}
