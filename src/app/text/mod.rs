//! Text for the Hugging Face families: a `tokenizer.json` through Hugging Face's own
//! `tokenizers` crate ([`Tokenizer`]), corpora read a batch of documents at a time
//! ([`documents`]) and tokenized once into memory-mapped token files ([`tokens`]), and the
//! order a run reads their windows in ([`sampler`]).

pub mod documents;
mod pattern;
pub mod sampler;
pub mod tokens;
mod words;

use std::path::{Path, PathBuf};

use self::words::Words;
use crate::app::file_error::{FileError, read_optional_json};
use crate::app::hf::TOKENIZER_CONFIG_FILE;

/// A `tokenizer.json`: text to token ids and back, exactly as Hugging Face's tokenizers do
/// (same crate); a text's own ids, or a document's and a prompt's with the special tokens
/// its post-processor puts around every text, as `transformers`' `tokenizer(text)` adds them.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    file: PathBuf,
    /// Whether a text may be cut before any space that follows a non-space and precedes
    /// one, and encoded piece by piece (see [`Tokenizer::encode_long`]).
    splits_at_spaces: bool,
    /// A GPT-2-style byte-level BPE's pre-tokens, each encoded once (`words.rs`).
    words: Option<Words>,
    /// The tokens its post-processor puts before every text (LLaMA's `<s>` or
    /// `<|begin_of_text|>`).
    before: Vec<u32>,
    /// The tokens it puts after every text (an end token, for some).
    after: Vec<u32>,
}

/// End-of-text tokens by their usual names, for a tokenizer whose config names none.
pub const USUAL_EOS: [&str; 5] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>"];

/// Pieces [`Tokenizer::encode_long`] cuts a long text into, in bytes at least.
const PIECE_BYTES: usize = 1 << 16;

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({}, {} tokens)", self.file.display(), self.vocab_size())
    }
}

impl Tokenizer {
    /// Reads `path`.
    ///
    /// Truncation and padding the file may configure are turned off, as `transformers`
    /// does unless asked for them: a long document is never cut.
    pub fn from_file(path: &Path) -> Result<Self, FileError> {
        let error = |e: tokenizers::Error| FileError::new(path, format!("not a usable tokenizer.json: {e}"));
        let mut inner = tokenizers::Tokenizer::from_file(path).map_err(error)?;
        inner.with_truncation(None).map_err(error)?;
        inner.with_padding(None);
        let (before, after) = around(&inner).map_err(|why| FileError::new(path, why))?;
        let splits_at_spaces = splits_at_spaces(&inner);
        let words = Words::of(&inner);
        Ok(Self { inner, file: path.to_path_buf(), splits_at_spaces, words, before, after })
    }

    /// The file it was read from.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Token ids of `text` (a GPT-2-style byte-level BPE's through a cache of the words
    /// it has seen, the same ids: `words.rs`).
    fn encode(&self, text: &str) -> Result<Vec<u32>, FileError> {
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
    fn encode_long(&self, text: &str) -> Result<Vec<u32>, FileError> {
        use rayon::prelude::*;
        if !self.splits_at_spaces || text.len() < 2 * PIECE_BYTES {
            return self.encode(text);
        }
        let pieces = cut_at_spaces(text, PIECE_BYTES);
        let ids: Vec<Vec<u32>> = pieces.par_iter().map(|p| self.encode(p)).collect::<Result<_, _>>()?;
        Ok(ids.concat())
    }

    /// Token ids of a document as `transformers`' `tokenizer(text)` gives them: the text's
    /// (`encode_long`: in pieces on every core where the tokenizer allows it) between the
    /// special tokens the tokenizer puts around every text (a LLaMA tokenizer's beginning-of-text token; none for GPT-2's or
    /// Qwen2's).
    pub fn encode_document(&self, text: &str) -> Result<Vec<u32>, FileError> {
        let ids = self.encode_long(text)?;
        if self.before.is_empty() && self.after.is_empty() {
            return Ok(ids); // no copy, for the tokenizers (GPT-2's, Qwen2's) that add nothing
        }
        Ok([&self.before[..], &ids, &self.after].concat())
    }

    /// Token ids of a prompt to continue: the text's after the tokens the tokenizer puts
    /// before every text (none of those it puts after, which would end it).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, FileError> {
        Ok([&self.before[..], &self.encode(text)?].concat())
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, FileError> {
        self.inner.decode(ids, false).map_err(|e| self.error(format!("cannot decode: {e}")))
    }

    /// Its vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The end-of-text token that closes each document of a token file, as `transformers`
    /// picks a tokenizer's: the `eos_token` of the `tokenizer_config.json` beside it, else
    /// the first of the usual names ([`USUAL_EOS`]) it has. Its id and text; an error where
    /// it has none, or the config names a token the tokenizer lacks.
    pub fn end_of_text(&self) -> Result<(u32, String), FileError> {
        let config = self.file.with_file_name(TOKENIZER_CONFIG_FILE);
        if let Some(name) = configured_eos(&config)? {
            let id = self.token_id(&name).ok_or_else(|| {
                FileError::new(&config, format!("eos_token `{name}` is not a token of {}", self.file.display()))
            })?;
            return Ok((id, name));
        }
        USUAL_EOS.iter().find_map(|t| Some((self.token_id(t)?, t.to_string()))).ok_or_else(|| {
            self.error(format!(
                "no end-of-text token to close documents with: none of {USUAL_EOS:?}, and no {TOKENIZER_CONFIG_FILE} \
                 beside it naming its eos_token"
            ))
        })
    }

    /// The id of `token` (an end-of-text token such as `<|endoftext|>`), if it has one.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn error(&self, message: String) -> FileError {
        FileError::new(&self.file, message)
    }
}

/// The special tokens `tokenizer`'s post-processor puts before and after every text: what
/// encoding a probe with them adds around its ids without them.
fn around(tokenizer: &tokenizers::Tokenizer) -> Result<(Vec<u32>, Vec<u32>), String> {
    const PROBE: &str = "probe";
    let ids = |special| tokenizer.encode_fast(PROBE, special).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string());
    let (plain, with) = (ids(false)?, ids(true)?);
    let at = (0..=with.len().saturating_sub(plain.len())).find(|&i| with[i..].starts_with(&plain));
    match at {
        _ if plain.is_empty() && with.is_empty() => Ok((Vec::new(), Vec::new())),
        Some(i) if !plain.is_empty() => Ok((with[..i].to_vec(), with[i + plain.len()..].to_vec())),
        _ => Err(format!(
            "its post-processor turns the ids {plain:?} of `{PROBE}` into {with:?}, not adding tokens around them: \
             not supported"
        )),
    }
}

/// The `eos_token` a `tokenizer_config.json` names (a string, or an added token's
/// `content`), if the file exists and names one.
fn configured_eos(path: &Path) -> Result<Option<String>, FileError> {
    use serde_json::Value;
    let Some(json) = read_optional_json(path)? else { return Ok(None) };
    match json.get("eos_token") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(name)) => Ok(Some(name.clone())),
        Some(Value::Object(token)) => match token.get("content") {
            Some(Value::String(name)) => Ok(Some(name.clone())),
            _ => Err(FileError::new(path, "eos_token has no string `content`")),
        },
        Some(other) => Err(FileError::new(path, format!("eos_token must be a string or a token, not {other}"))),
    }
}

/// A byte-level BPE as GPT-2's (its pre-tokenizer and decoder, no prefix space) trained
/// on `documents` to `vocab` tokens, `<|endoftext|>` among them (`tokenize --train-vocab`).
pub fn train_byte_level_bpe<S: AsRef<str> + Send>(
    documents: impl Iterator<Item = S> + Send,
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
    tokenizer.train(&mut trainer, documents)?;
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

    /// A test's own folder.
    fn folder(test: &str) -> PathBuf {
        std::env::temp_dir().join(format!("zerotrain-text-{}-{test}", std::process::id()))
    }

    /// A folder `name` in `parent` holding `tokenizer` as tokenizer.json and, if given,
    /// `config` as tokenizer_config.json; the tokenizer read back.
    fn saved(parent: &Path, name: &str, tokenizer: &tokenizers::Tokenizer, config: Option<&str>) -> Tokenizer {
        let dir = parent.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("tokenizer.json");
        tokenizer.save(&file, false).unwrap();
        match config {
            Some(text) => std::fs::write(dir.join(TOKENIZER_CONFIG_FILE), text).unwrap(),
            None => drop(std::fs::remove_file(dir.join(TOKENIZER_CONFIG_FILE))),
        }
        Tokenizer::from_file(&file).unwrap()
    }

    #[test]
    fn documents_end_with_the_token_the_tokenizer_config_names_else_a_usual_one() {
        let dir = folder("eos");
        let mut bpe = train_byte_level_bpe(["the rank holds a shard"].into_iter(), 300).unwrap();
        bpe.add_special_tokens(&[tokenizers::AddedToken::from("</s>", true)]);
        let (text, s) = (bpe.token_to_id("<|endoftext|>").unwrap(), bpe.token_to_id("</s>").unwrap());
        assert_ne!(text, s);
        let plain = saved(&dir, "plain", &bpe, None);
        assert_eq!(plain.end_of_text().unwrap(), (text, "<|endoftext|>".to_string()));
        let named = saved(&dir, "named", &bpe, Some(r#"{"eos_token": {"content": "</s>", "special": true}}"#));
        assert_eq!(named.end_of_text().unwrap(), (s, "</s>".to_string()));
        let string = saved(&dir, "string", &bpe, Some(r#"{"eos_token": "</s>", "bos_token": null}"#));
        assert_eq!(string.end_of_text().unwrap().0, s);
        let unset = saved(&dir, "unset", &bpe, Some(r#"{"eos_token": null}"#));
        assert_eq!(unset.end_of_text().unwrap().0, text);
        let err = |t: Tokenizer| t.end_of_text().unwrap_err().to_string();
        let absent = err(saved(&dir, "absent", &bpe, Some(r#"{"eos_token": "<|eot_id|>"}"#)));
        assert!(absent.contains("tokenizer_config.json: eos_token `<|eot_id|>` is not a token of"), "{absent}");
        assert!(err(saved(&dir, "broken", &bpe, Some("{"))).contains("tokenizer_config.json: not JSON"));
        let mut bare = tokenizers::Tokenizer::new(tokenizers::models::bpe::BPE::default());
        bare.add_tokens(&[tokenizers::AddedToken::from("word", false)]);
        let none = err(saved(&dir, "none", &bare, None));
        assert!(none.contains("tokenizer.json: no end-of-text token to close documents with"), "{none}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A document gets the tokens the tokenizer's post-processor puts around every text, as
    /// the crate's own encoding with special tokens does (LLaMA's beginning-of-text token),
    /// and is never cut by the truncation a tokenizer.json may configure; a prompt gets the
    /// ones before it only.
    #[test]
    fn documents_are_encoded_as_transformers_encodes_a_text_and_never_cut() {
        use tokenizers::processors::template::TemplateProcessing;
        let mut bpe = train_byte_level_bpe(["the rank holds a shard of state"].into_iter(), 300).unwrap();
        bpe.add_special_tokens(&[
            tokenizers::AddedToken::from("<s>", true),
            tokenizers::AddedToken::from("</s>", true),
        ]);
        let (bos, eos) = (bpe.token_to_id("<s>").unwrap(), bpe.token_to_id("</s>").unwrap());
        let template = TemplateProcessing::builder()
            .try_single("<s> $A </s>")
            .unwrap()
            .special_tokens(vec![("<s>", bos), ("</s>", eos)])
            .build()
            .unwrap();
        bpe.with_post_processor(Some(template));
        let text = "the rank holds a shard of state and the rank holds a shard";
        let expected = bpe.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!((expected[0], expected[expected.len() - 1]), (bos, eos));
        let truncation = tokenizers::TruncationParams { max_length: 4, ..Default::default() };
        bpe.with_truncation(Some(truncation)).unwrap();
        assert_eq!(bpe.encode(text, true).unwrap().get_ids().len(), 4, "the file's own setting cuts");
        let dir = folder("template");
        let tokenizer = saved(&dir, "template", &bpe, None);
        assert_eq!(tokenizer.encode_document(text).unwrap(), expected);
        assert_eq!(tokenizer.encode_prompt(text).unwrap(), expected[..expected.len() - 1]);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
