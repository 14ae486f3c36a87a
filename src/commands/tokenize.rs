//! `zerotrain tokenize`: text or JSON-lines files into a token file (see
//! [`tokens`](zerotrain_models::text::tokens)), with a tokenizer given or a byte-level BPE trained
//! on the same files; the files are read a batch of documents at a time.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::bail;

use zerotrain_models::text::Tokenizer;
use zerotrain_models::text::documents::Documents;

/// What `zerotrain tokenize` was asked.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenizeArgs {
    /// Text files (a document per blank-line-separated paragraph) or `.jsonl` files (a
    /// document per line).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// The tokenizer.json to use (or to write, with --train-vocab).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Train a byte-level BPE of this many tokens on the inputs and write it to --tokenizer.
    #[arg(long)]
    pub train_vocab: Option<usize>,
    /// The token file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// The share of the tokens held out for validation (the file's end).
    #[arg(long, default_value_t = 0.01)]
    pub valid_fraction: f64,
    /// The JSON-lines field holding each document's text.
    #[arg(long, default_value = "text")]
    pub field: String,
}

/// The largest vocabulary `--train-vocab` trains: 2^24, the largest `vocab_size` a model's
/// config may have (the trainer allocates by the size asked).
const MAX_TRAIN_VOCAB: usize = 1 << 24;

/// A byte-level BPE of `vocab` tokens (`<|endoftext|>` among them) trained on the documents
/// of `args`' files, read as the trainer asks for them.
fn train_bpe(args: &TokenizeArgs, vocab: usize) -> anyhow::Result<Tokenizer> {
    if vocab < 257 {
        bail!("--train-vocab {vocab}: a byte-level BPE needs at least 257 tokens (256 bytes and <|endoftext|>)");
    }
    if vocab > MAX_TRAIN_VOCAB {
        bail!("--train-vocab {vocab}: at most {MAX_TRAIN_VOCAB} tokens (a model's vocabulary is at most that)");
    }
    // The trainer takes plain texts: the first error ends the stream and is kept for after.
    let failed = Mutex::new(None);
    let stream = Documents::new(&args.inputs, &args.field)
        .map_while(|document| document.map_err(|e| *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e)).ok());
    let trained = zerotrain_models::text::train_byte_level_bpe(stream, vocab);
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e.into());
    }
    let tokenizer = trained.map_err(|e| anyhow::anyhow!("training the BPE failed: {e}"))?;
    let out = &args.tokenizer;
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
    for input in &args.inputs {
        if same_file(input, &args.out) {
            bail!(
                "--out {} is an input: the token file would replace the text (nothing was written)",
                args.out.display()
            );
        }
        if args.train_vocab.is_some() && same_file(input, &args.tokenizer) {
            bail!(
                "--tokenizer {} is an input: the trained tokenizer would replace the text (nothing was written)",
                args.tokenizer.display()
            );
        }
    }
    if same_file(&args.out, &args.tokenizer) {
        bail!("--out and --tokenizer are one file, {}: give each its own (nothing was written)", args.out.display());
    }
    let start = Instant::now();
    let tokenizer = match args.train_vocab {
        Some(vocab) => train_bpe(&args, vocab)?,
        None => Tokenizer::from_file(&args.tokenizer)?,
    };
    let trained = start.elapsed().as_secs_f64();
    let (eos, eos_name) = tokenizer.end_of_text()?;
    let encode_start = Instant::now();
    let documents = Documents::new(&args.inputs, &args.field);
    let (file, text_bytes) = documents.write_token_file(&tokenizer, &args.out, args.valid_fraction)?;
    let seconds = encode_start.elapsed().as_secs_f64();
    println!(
        "wrote {}: {} tokens ({} held out) in {} documents each closed by {eos_name} (id {eos}), ids below {} \
         ({}), {:.1} MB of text at {:.1} MB/s{}",
        args.out.display(),
        file.len(),
        file.len() - file.train_tokens(),
        file.documents(),
        tokenizer.id_bound(),
        args.tokenizer.display(),
        text_bytes as f64 / 1e6,
        text_bytes as f64 / 1e6 / seconds.max(1e-9),
        if args.train_vocab.is_some() { format!(" (BPE trained in {trained:.1} s)") } else { String::new() }
    );
    Ok(())
}

/// Whether `a` and `b` name one file: the same file where both exist (links, `..`, another
/// spelling), else the same path once their folders are resolved.
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
        return (x.dev(), x.ino()) == (y.dev(), y.ino());
    }
    let resolved = |p: &std::path::Path| {
        let parent = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        parent.canonicalize().ok().map(|d| d.join(p.file_name().unwrap_or_default()))
    };
    resolved(a).is_some_and(|x| Some(x) == resolved(b))
}
