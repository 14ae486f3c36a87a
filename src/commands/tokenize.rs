//! `zerotrain tokenize`: text or JSON-lines files into a token file (see
//! [`tokens`](zerotrain_models::text::tokens)), with a tokenizer given or a byte-level BPE trained
//! on the same files; the files are read a batch of documents at a time. Fine-tuning rows
//! (conversations, prompts and completions) make a file of sequences with loss masks
//! ([`finetune`](zerotrain_models::text::finetune)).

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::bail;

use zerotrain_models::file_error::FileError;
use zerotrain_models::text::Tokenizer;
use zerotrain_models::text::documents::Documents;

/// What `zerotrain tokenize` was asked.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenizeArgs {
    /// Text files (a document per blank-line-separated paragraph), `.jsonl` files (a
    /// document per line, or fine-tuning rows), `.json` lists of rows or `.parquet` files
    /// of rows.
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
    /// What `.jsonl`, `.json` and `.parquet` rows hold, for fine-tuning: `auto` (each row by its
    /// columns: `messages`, else `prompt` and `completion`, else `text`), `text`,
    /// `messages` or `prompt-completion`. Rows of conversations or prompts make a token
    /// file of sequences with loss masks.
    #[arg(long)]
    pub format: Option<String>,
    /// The chat template conversations are rendered with (a Jinja file), instead of the
    /// tokenizer's own (`chat_template.jinja` or the `chat_template` of the
    /// `tokenizer_config.json` beside --tokenizer).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Which tokens of a fine-tuning row the loss is on: `default` (a conversation's
    /// assistant turns, a prompt's completion, a text's every token), `assistant`,
    /// `completion` or `all`.
    #[arg(long)]
    pub loss_on: Option<String>,
    /// The most tokens a fine-tuning row keeps (TRL's `max_length`): a longer one is cut to
    /// its first N tokens, or left out with --drop-long; each counted in the summary.
    #[arg(long, value_name = "N")]
    pub max_length: Option<usize>,
    /// With --max-length: leave longer rows out instead of cutting them.
    #[arg(long)]
    pub drop_long: bool,
}

/// Whether `args` asks for fine-tuning rows: a flag of theirs is given, an input is a
/// `.json` list of rows or a Parquet file, or the first row of a `.jsonl` input holds
/// `messages` or a `prompt` (a `--field` other than `text` keeps JSON lines as documents).
fn reads_rows(args: &TokenizeArgs) -> anyhow::Result<bool> {
    use std::io::BufRead;
    if args.field != "text" {
        return Ok(false);
    }
    let mut rows =
        args.format.is_some() || args.chat_template.is_some() || args.loss_on.is_some() || args.max_length.is_some();
    for input in args.inputs.iter().filter(|i| zerotrain_models::text::finetune::is_rows_file(i)) {
        // Only a regular file: a FIFO's open would wait for a writer, a device never end.
        let file = zerotrain_checkpoint::open_regular(input)
            .map_err(|e| FileError::new(input, format!("cannot open it: {e}")))?;
        rows |= match input.extension().and_then(|e| e.to_str()) {
            Some("jsonl") => {
                let first = std::io::BufReader::new(file).lines().map_while(Result::ok).find(|l| !l.trim().is_empty());
                let row: Option<serde_json::Value> = first.and_then(|l| serde_json::from_str(&l).ok());
                row.is_some_and(|r| r.get("messages").is_some() || r.get("prompt").is_some())
            }
            _ => true,
        };
    }
    Ok(rows)
}

/// Fine-tuning rows into a token file of sequences (`finetune::write_rows_token_file`),
/// and what was written, said.
fn tokenize_rows(args: &TokenizeArgs, tokenizer: &Tokenizer) -> anyhow::Result<()> {
    use zerotrain_models::text::finetune::{self, ChatTemplate, Format, LossOn, RowsInput};
    let format: Format = match &args.format {
        Some(f) => f.parse().map_err(|e| anyhow::anyhow!("--format: {e}"))?,
        None => Format::Auto,
    };
    let loss_on: LossOn = match &args.loss_on {
        Some(l) => l.parse().map_err(|e| anyhow::anyhow!("--loss-on: {e}"))?,
        None => LossOn::Default,
    };
    // A template given must be usable; the tokenizer's own is needed only by rows of messages.
    let template = match ChatTemplate::for_tokenizer(&args.tokenizer, args.chat_template.as_deref()) {
        Err(e) if args.chat_template.is_some() => return Err(e.into()),
        found => found.map_err(|e| e.to_string()),
    };
    let max_length = match (args.max_length, args.drop_long) {
        (Some(n), _) if n < 2 => bail!("--max-length {n}: a row needs at least 2 tokens to train on one"),
        (Some(n), drop) => Some((n, drop)),
        (None, true) => bail!("--drop-long leaves out the rows longer than --max-length: give --max-length N"),
        (None, false) => None,
    };
    let input = RowsInput { tokenizer, template: template.as_ref().map_err(Clone::clone), format, loss_on, max_length };
    let start = Instant::now();
    let (file, summary) = finetune::write_rows_token_file(&args.inputs, &input, &args.out, args.valid_fraction)?;
    let seconds = start.elapsed().as_secs_f64();
    let bytes: u64 = args.inputs.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
    let sequences = summary.conversations + summary.prompt_completions + summary.texts;
    let counted = file.counted_in(0..file.len());
    println!(
        "wrote {}: {} tokens ({} held out, whole sequences) in {} ({}, {}, {}), the loss on {} tokens \
         ({:.1}%){}; {:.1} MB of rows at {:.1} MB/s{}",
        args.out.display(),
        file.len(),
        file.len() - file.train_tokens(),
        super::count(sequences, "sequence"),
        super::count(summary.conversations, "conversation"),
        super::count(summary.prompt_completions, "prompt/completion row"),
        super::count(summary.texts, "text"),
        counted,
        100.0 * counted as f64 / file.len().max(1) as f64,
        [
            (summary.truncated, "longer than --max-length cut to their start"),
            (summary.dropped, "longer than --max-length left out"),
            (summary.skipped, "without a token to train on left out"),
        ]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("; {} {what}", super::count(*n, "row")))
        .collect::<String>(),
        bytes as f64 / 1e6,
        bytes as f64 / 1e6 / seconds.max(1e-9),
        match &template {
            Ok(t) if summary.conversations > 0 || args.chat_template.is_some() =>
                format!(" (chat template {})", t.origin()),
            _ => String::new(),
        }
    );
    Ok(())
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
    let rows = reads_rows(&args)?;
    if rows && args.train_vocab.is_some() {
        bail!(
            "--train-vocab trains on plain text, not on fine-tuning rows: train the tokenizer on a text file first \
             (or fine-tune with the model's own tokenizer), then tokenize the rows with it"
        );
    }
    let start = Instant::now();
    let tokenizer = match args.train_vocab {
        Some(vocab) => train_bpe(&args, vocab)?,
        None => Tokenizer::from_file(&args.tokenizer)?,
    };
    let trained = start.elapsed().as_secs_f64();
    if rows {
        return tokenize_rows(&args, &tokenizer);
    }
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
