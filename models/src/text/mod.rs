//! Text for the Hugging Face families: a `tokenizer.json` through Hugging Face's own
//! `tokenizers` crate ([`Tokenizer`]), corpora read a batch of documents at a time
//! ([`documents`]) and tokenized once into memory-mapped token files ([`tokens`]), and the
//! order a run reads their windows in ([`sampler`]).

pub mod documents;
pub mod finetune;
mod pattern;
pub mod sampler;
pub mod sequences;
pub mod tokens;
mod words;

use std::path::{Path, PathBuf};

use self::words::Words;
use crate::file_error::{FileError, read_optional_json};
use crate::hf::TOKENIZER_CONFIG_FILE;

/// The characters a token covers: (first, one past the last), counted as Python counts them.
pub type CharSpan = (usize, usize);

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
    /// One past its largest id (added tokens included).
    id_bound: usize,
    /// A hash of every id and its token ([`Tokenizer::fingerprint`]).
    fingerprint: u64,
}

/// End-of-text tokens by their usual names, for a tokenizer whose config names none.
pub const USUAL_EOS: [&str; 5] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>"];

/// Pieces [`Tokenizer::encode_long`] cuts a long text into, in bytes at least.
const PIECE_BYTES: usize = 1 << 16;

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({}, ids below {})", self.file.display(), self.id_bound)
    }
}

impl Tokenizer {
    /// Reads `path`.
    ///
    /// Truncation and padding the file may configure are turned off, as `transformers`
    /// does unless asked for them: a long document is never cut.
    pub fn from_file(path: &Path) -> Result<Self, FileError> {
        let error = |e: tokenizers::Error| FileError::new(path, format!("not a usable tokenizer.json: {e}"));
        let bytes = crate::file_error::read_file(path)?;
        let mut inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(error)?;
        inner.with_truncation(None).map_err(error)?;
        inner.with_padding(None);
        let (before, after) = around(&inner).map_err(|why| FileError::new(path, why))?;
        let (before, after) = configured_around(&inner, &path.with_file_name(TOKENIZER_CONFIG_FILE), (before, after))?;
        let splits_at_spaces = splits_at_spaces(&inner);
        let words = Words::of(&inner);
        let (id_bound, fingerprint) = identity(&inner);
        Ok(Self { inner, file: path.to_path_buf(), splits_at_spaces, words, before, after, id_bound, fingerprint })
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

    /// Token ids of `text` alone (none of the special tokens the tokenizer puts around a
    /// text: a chat template writes its own), each with the characters it covers, counted
    /// as Python counts them (Unicode scalar values): what `transformers` gets from
    /// `tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)`.
    pub fn encode_with_char_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<CharSpan>), FileError> {
        let encoding =
            self.inner.encode_char_offsets(text, false).map_err(|e| self.error(format!("cannot encode: {e}")))?;
        Ok((encoding.get_ids().to_vec(), encoding.get_offsets().to_vec()))
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, FileError> {
        self.inner.decode(ids, false).map_err(|e| self.error(format!("cannot decode: {e}")))
    }

    /// The text `new` adds after `prompt` (ids), as `transformers` decodes a generation:
    /// the two decoded together, less the prompt's own decoding. A SentencePiece-style
    /// decoder (Metaspace) takes the space off a text's first word, so decoding `new` alone
    /// would lose the space between prompt and continuation. Where the prompt's decoding is
    /// not a prefix of the whole (a decoder that merges across the seam), the whole.
    pub fn decode_continuation(&self, prompt: &[u32], new: &[u32]) -> Result<String, FileError> {
        let whole = self.decode(&[prompt, new].concat())?;
        let head = self.decode(prompt)?;
        Ok(match whole.strip_prefix(&head) {
            Some(tail) => tail.to_string(),
            None => whole,
        })
    }

    /// Whether id `id` is one of its tokens' (a model's vocabulary may be padded past them,
    /// and an id may fall in a gap: such an id decodes as nothing).
    pub fn has_token(&self, id: u32) -> bool {
        self.inner.id_to_token(id).is_some()
    }

    /// One past its largest id, added tokens included: the rows an embedding indexed by its
    /// ids needs, and the bound a token file's ids are checked against. Not its number of
    /// tokens, which is smaller where ids leave gaps (an added token placed at a high id).
    pub fn id_bound(&self) -> usize {
        self.id_bound
    }

    /// A hash of every id with its token's text: two tokenizers that give the same ids the
    /// same tokens have the same fingerprint, whatever else their files hold. A token file
    /// records its tokenizer's, so that reading it with another is refused.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
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

/// (`id_bound`, `fingerprint`) of `tokenizer` (see [`Tokenizer::id_bound`] and
/// [`Tokenizer::fingerprint`]): FNV-1a over each id and its token, in id order.
fn identity(tokenizer: &tokenizers::Tokenizer) -> (usize, u64) {
    let mut tokens: Vec<(u32, String)> = tokenizer.get_vocab(true).into_iter().map(|(t, id)| (id, t)).collect();
    tokens.sort_unstable();
    let bound = tokens.last().map_or(0, |(id, _)| *id as usize + 1);
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for (id, token) in &tokens {
        for byte in id.to_le_bytes().iter().chain(token.as_bytes()).chain([0xFF].iter()) {
            hash = (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    (bound, hash)
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
    let Some(json) = read_optional_json(path)? else { return Ok(None) };
    configured_token(&json, "eos_token").map_err(|why| FileError::new(path, why))
}

/// The token a `tokenizer_config.json`'s `key` names (a string, or an added token's
/// `content`), if it names one.
fn configured_token(json: &serde_json::Value, key: &str) -> Result<Option<String>, String> {
    use serde_json::Value;
    match json.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(name)) => Ok(Some(name.clone())),
        Some(Value::Object(token)) => match token.get("content") {
            Some(Value::String(name)) => Ok(Some(name.clone())),
            _ => Err(format!("{key} has no string `content`")),
        },
        Some(other) => Err(format!("{key} must be a string or a token, not {other}")),
    }
}

/// The tokens put before and after every text once the `tokenizer_config.json` beside the
/// tokenizer (`config`) has its say: `transformers` rebuilds a tokenizer's post-processor
/// from `add_bos_token` and `add_eos_token` when the config sets them (`bos_token` before
/// every text when `add_bos_token` is true, `eos_token` after it when `add_eos_token` is),
/// so a config that sets one decides that side; a side it leaves unset stays as the
/// `tokenizer.json`'s post-processor has it (`around`).
fn configured_around(
    tokenizer: &tokenizers::Tokenizer,
    config: &Path,
    (before, after): (Vec<u32>, Vec<u32>),
) -> Result<(Vec<u32>, Vec<u32>), FileError> {
    let Some(json) = read_optional_json(config)? else { return Ok((before, after)) };
    let error = |why: String| FileError::new(config, why);
    let side = |flag: &str, token: &str, keep: Vec<u32>| -> Result<Vec<u32>, FileError> {
        match json.get(flag) {
            None | Some(serde_json::Value::Null) => Ok(keep),
            Some(serde_json::Value::Bool(false)) => Ok(Vec::new()),
            Some(serde_json::Value::Bool(true)) => {
                let name = configured_token(&json, token)
                    .map_err(error)?
                    .ok_or_else(|| error(format!("{flag} is true but {token} is not set")))?;
                let id = tokenizer
                    .token_to_id(&name)
                    .ok_or_else(|| error(format!("{token} `{name}` is not a token of the tokenizer beside it")))?;
                Ok(vec![id])
            }
            Some(other) => Err(error(format!("{flag} must be true or false, not {other}"))),
        }
    };
    Ok((side("add_bos_token", "bos_token", before)?, side("add_eos_token", "eos_token", after)?))
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
        // A broken config beside the tokenizer is refused when the tokenizer is read (it
        // also decides the tokens around every text).
        let broken = dir.join("broken").join("tokenizer.json");
        std::fs::create_dir_all(broken.parent().unwrap()).unwrap();
        bpe.save(&broken, false).unwrap();
        std::fs::write(broken.with_file_name(TOKENIZER_CONFIG_FILE), "{").unwrap();
        let refused = Tokenizer::from_file(&broken).unwrap_err().to_string();
        assert!(refused.contains("tokenizer_config.json: not JSON"), "{refused}");
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

    /// A tokenizer with few tokens but an added token at a high id (as tokenizers whose
    /// special tokens sit above a gap have): the id bound is one past that id, not the
    /// token count, so a token file holds it in 32 bits and reads it back (it was once
    /// written in 16 bits: id 65636 as 100); the model check compares that bound.
    #[test]
    fn an_id_above_the_token_count_is_written_whole_and_bounds_the_vocabulary() {
        let dir = folder("sparse");
        let bpe = train_byte_level_bpe(["the rank holds a shard"].into_iter(), 300).unwrap();
        let mut json: serde_json::Value = serde_json::from_str(&bpe.to_string(false).unwrap()).unwrap();
        // The model's vocabulary may leave gaps; an added token then takes the model's id.
        json["model"]["vocab"]["<|big|>"] = serde_json::json!(65636);
        let big = serde_json::json!({"id": 65636, "content": "<|big|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true});
        json["added_tokens"].as_array_mut().unwrap().push(big);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("tokenizer.json");
        std::fs::write(&file, json.to_string()).unwrap();
        let tokenizer = Tokenizer::from_file(&file).unwrap();
        assert!(tokenizer.inner.get_vocab_size(true) <= 302, "few tokens");
        assert_eq!(tokenizer.id_bound(), 65637);
        let ids = tokenizer.encode_document("the rank<|big|> holds").unwrap();
        assert!(ids.contains(&65636), "{ids:?}");
        let path = dir.join("t.tokens");
        let mut writer =
            tokens::TokenFileWriter::create(&path, tokenizer.id_bound(), 0, tokenizer.fingerprint()).unwrap();
        writer.document(&ids).unwrap();
        let tokens = writer.finish(0.0).unwrap();
        tokens.verify().unwrap();
        let back: Vec<u32> = (0..ids.len()).map(|i| tokens.token(i)).collect();
        assert_eq!(back, ids);
        tokens.check_written_by(&tokenizer).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A token file names the tokenizer that wrote it: another tokenizer of the same size
    /// (trained on other text) is refused by name, with the fix.
    #[test]
    fn a_token_file_is_refused_by_another_tokenizer_of_the_same_size() {
        let dir = folder("fingerprint");
        let a = saved(&dir, "a", &train_byte_level_bpe(["the rank holds a shard"].into_iter(), 300).unwrap(), None);
        let b = saved(&dir, "b", &train_byte_level_bpe(["a shard holds the rank"].into_iter(), 300).unwrap(), None);
        assert_eq!(a.id_bound(), b.id_bound());
        assert_ne!(a.fingerprint(), b.fingerprint());
        let again =
            saved(&dir, "again", &train_byte_level_bpe(["the rank holds a shard"].into_iter(), 300).unwrap(), None);
        assert_eq!(a.fingerprint(), again.fingerprint(), "the same vocabulary, the same fingerprint");
        let path = dir.join("t.tokens");
        let mut writer = tokens::TokenFileWriter::create(&path, a.id_bound(), 0, a.fingerprint()).unwrap();
        writer.document(&a.encode_document("the rank holds").unwrap()).unwrap();
        let file = writer.finish(0.0).unwrap();
        file.check_written_by(&a).unwrap();
        let err = file.check_written_by(&b).unwrap_err().to_string();
        assert!(err.contains("t.tokens: it was written by another tokenizer than") && err.contains("b/tokenizer.json"));
        assert!(err.contains("tokenize the text again"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// With a SentencePiece-style tokenizer (Metaspace, as LLaMA 2's and Mistral's), whose
    /// decoder takes the space off a text's first word, a continuation is the text it adds
    /// after the prompt ("the cat" and " cat"), not its own decoding ("cat", which printed
    /// "thecat"); with GPT-2's byte-level BPE both agree.
    #[test]
    fn a_continuation_keeps_the_space_a_sentencepiece_decoder_drops_from_a_first_word() {
        use tokenizers::models::TrainerWrapper;
        use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
        use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
        use tokenizers::{DecoderWrapper, PreTokenizerWrapper};
        let metaspace = Metaspace::new('\u{2581}', PrependScheme::First, true);
        let mut sp = tokenizers::Tokenizer::new(BPE::default());
        sp.with_pre_tokenizer(Some(PreTokenizerWrapper::Metaspace(metaspace.clone())));
        sp.with_decoder(Some(DecoderWrapper::Metaspace(metaspace)));
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new().show_progress(false).vocab_size(60).build().into();
        sp.train(&mut trainer, ["the cat sat on the mat", "a cat and the cat"].into_iter()).unwrap();
        let dir = folder("metaspace");
        let bpe = train_byte_level_bpe(["the cat sat on the mat"].into_iter(), 300).unwrap();
        for (name, tokenizer) in [("sentencepiece", &sp), ("byte-level", &bpe)] {
            let t = saved(&dir, name, tokenizer, None);
            let (prompt, cat) = (t.encode_prompt("the").unwrap(), t.encode(" cat").unwrap());
            assert_eq!(t.decode(&[&prompt[..], &cat].concat()).unwrap(), "the cat", "{name}");
            assert_eq!(t.decode_continuation(&prompt, &cat).unwrap(), " cat", "{name}");
            if name == "sentencepiece" {
                assert_eq!(t.decode(&cat).unwrap(), "cat", "the decoder drops a first word's space");
            }
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// `tokenizer_config.json`'s `add_bos_token` / `add_eos_token` decide what is put around
    /// every text, as `transformers` rebuilds a LLaMA tokenizer's post-processor from them:
    /// both on give what a `<s> $A </s>` template gives; `add_bos_token: false` takes off the
    /// beginning token a `tokenizer.json`'s template puts; a flag without its token is an
    /// error naming the file.
    #[test]
    fn add_bos_and_eos_token_in_the_tokenizer_config_decide_the_tokens_around_a_text() {
        use tokenizers::processors::template::TemplateProcessing;
        let dir = folder("add-bos");
        let mut bpe = train_byte_level_bpe(["the rank holds a shard"].into_iter(), 300).unwrap();
        bpe.add_special_tokens(&[
            tokenizers::AddedToken::from("<s>", true),
            tokenizers::AddedToken::from("</s>", true),
        ]);
        let (bos, eos) = (bpe.token_to_id("<s>").unwrap(), bpe.token_to_id("</s>").unwrap());
        let text = "the rank holds";
        let plain = bpe.encode(text, false).unwrap().get_ids().to_vec();
        let mut both = bpe.clone();
        let template = |single: &str| {
            TemplateProcessing::builder()
                .try_single(single)
                .unwrap()
                .special_tokens(vec![("<s>", bos), ("</s>", eos)])
                .build()
                .unwrap()
        };
        both.with_post_processor(Some(template("<s> $A </s>")));
        let expected = both.encode(text, true).unwrap().get_ids().to_vec();
        let config = r#"{"add_bos_token": true, "add_eos_token": true, "bos_token": "<s>",
                         "eos_token": {"content": "</s>", "special": true}}"#;
        let flagged = saved(&dir, "flagged", &bpe, Some(config));
        assert_eq!(flagged.encode_document(text).unwrap(), expected);
        assert_eq!(flagged.encode_prompt(text).unwrap(), expected[..expected.len() - 1]);
        let mut begins = bpe.clone();
        begins.with_post_processor(Some(template("<s> $A")));
        let kept = saved(&dir, "kept", &begins, Some(r#"{"eos_token": "</s>"}"#));
        assert_eq!(kept.encode_document(text).unwrap(), [&[bos][..], &plain].concat(), "no flag: the template's");
        let off = saved(&dir, "off", &begins, Some(r#"{"add_bos_token": false}"#));
        assert_eq!(off.encode_document(text).unwrap(), plain);
        let file = dir.join("missing").join("tokenizer.json");
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        bpe.save(&file, false).unwrap();
        std::fs::write(file.with_file_name(TOKENIZER_CONFIG_FILE), r#"{"add_eos_token": true}"#).unwrap();
        let err = Tokenizer::from_file(&file).unwrap_err().to_string();
        assert!(err.contains("tokenizer_config.json: add_eos_token is true but eos_token is not set"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
