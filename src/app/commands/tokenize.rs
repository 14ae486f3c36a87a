//! `zerotrain tokenize`: text or JSON-lines files into a token file (see
//! [`tokens`](crate::app::text::tokens)), with a tokenizer given or a byte-level BPE trained
//! on the same files.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use rayon::prelude::*;

use crate::app::text::Tokenizer;
use crate::app::text::tokens::TokenFileWriter;

/// What `zerotrain tokenize` was asked.
#[derive(Debug, Clone)]
pub struct TokenizeArgs {
    /// Text files (a document per blank-line-separated paragraph) or JSON-lines files
    /// (`.jsonl`: a document per line, its `field`).
    pub inputs: Vec<PathBuf>,
    /// The `tokenizer.json` to use, or to write when `train_vocab` is set.
    pub tokenizer: PathBuf,
    /// Train a byte-level BPE of this many tokens on the inputs first.
    pub train_vocab: Option<usize>,
    /// The token file to write.
    pub out: PathBuf,
    /// The held-out share of the tokens (the file's end).
    pub valid_fraction: f64,
    /// The JSON-lines field holding the text.
    pub field: String,
}

/// Documents of one input file, in order.
fn documents(path: &Path, field: &str) -> anyhow::Result<Vec<String>> {
    let jsonl = path.extension().is_some_and(|e| e == "jsonl" || e == "ndjson");
    if !jsonl {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read {} as UTF-8 text", path.display()))?;
        return Ok(text.split("\n\n").filter(|d| !d.trim().is_empty()).map(str::to_string).collect());
    }
    let file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("cannot read {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("{} line {}: not JSON", path.display(), i + 1))?;
        match value.get(field) {
            Some(serde_json::Value::String(text)) => out.push(text.clone()),
            _ => bail!("{} line {}: no string field `{field}` (choose it with --field)", path.display(), i + 1),
        }
    }
    Ok(out)
}

/// A byte-level BPE of `vocab` tokens (`<|endoftext|>` among them) trained on `documents`.
fn train_bpe(documents: &[String], vocab: usize, out: &Path) -> anyhow::Result<Tokenizer> {
    if vocab < 257 {
        bail!("--train-vocab {vocab}: a byte-level BPE needs at least 257 tokens (256 bytes and <|endoftext|>)");
    }
    let tokenizer = crate::app::text::train_byte_level_bpe(documents, vocab)
        .map_err(|e| anyhow::anyhow!("training the BPE failed: {e}"))?;
    tokenizer.save(out, true).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", out.display()))?;
    Ok(Tokenizer::from_file(out)?)
}

/// `zerotrain tokenize`.
pub fn tokenize(args: TokenizeArgs) -> anyhow::Result<()> {
    if !(0.0..1.0).contains(&args.valid_fraction) {
        bail!("--valid-fraction must be at least 0 and less than 1, not {}", args.valid_fraction);
    }
    if args.inputs.is_empty() {
        bail!("give the text or JSON-lines files to tokenize");
    }
    let start = Instant::now();
    let mut docs = Vec::new();
    for input in &args.inputs {
        docs.extend(documents(input, &args.field)?);
    }
    let text_bytes: usize = docs.iter().map(String::len).sum();
    let tokenizer = match args.train_vocab {
        Some(vocab) => train_bpe(&docs, vocab, &args.tokenizer)?,
        None => Tokenizer::from_file(&args.tokenizer)?,
    };
    let trained = start.elapsed().as_secs_f64();
    let (eos, eos_name) = tokenizer.end_of_text()?;
    let mut writer = TokenFileWriter::create(&args.out, tokenizer.vocab_size(), eos)?;
    let encode_start = Instant::now();
    // Documents are encoded in parallel a batch at a time and written in order.
    for batch in docs.chunks(256) {
        let ids: Vec<Vec<u32>> = batch.par_iter().map(|d| tokenizer.encode_document(d)).collect::<Result<_, _>>()?;
        for doc in &ids {
            writer.document(doc)?;
        }
    }
    let file = writer.finish(args.valid_fraction)?;
    let seconds = encode_start.elapsed().as_secs_f64();
    println!(
        "wrote {}: {} tokens ({} held out) in {} documents each closed by {eos_name} (id {eos}), vocabulary {} \
         ({}), {:.1} MB of text at {:.1} MB/s{}",
        args.out.display(),
        file.len(),
        file.len() - file.train_tokens(),
        file.documents(),
        tokenizer.vocab_size(),
        args.tokenizer.display(),
        text_bytes as f64 / 1e6,
        text_bytes as f64 / 1e6 / seconds.max(1e-9),
        if args.train_vocab.is_some() { format!(" (BPE trained in {trained:.1} s)") } else { String::new() }
    );
    Ok(())
}
