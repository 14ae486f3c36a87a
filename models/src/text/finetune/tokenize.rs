//! Fine-tuning files into a token file of sequences (`zerotrain tokenize` of `.jsonl` or
//! `.json` rows): each row tokenized with its loss mask ([`encode_row`]) a batch at a time
//! on every core, written in order as one sequence; plain text files among the inputs are
//! read as documents, as a corpus is.

use std::path::{Path, PathBuf};

use super::masks::{LossOn, encode_row};
use super::rows::{Format, Row, is_rows_file, read_rows};
use super::template::ChatTemplate;
use crate::file_error::FileError;
use crate::text::Tokenizer;
use crate::text::documents::Documents;
use crate::text::tokens::{TokenFile, TokenFileWriter};

/// Rows encoded at a time, in parallel.
const BATCH_ROWS: usize = 1024;

/// How rows are read and tokenized.
pub struct RowsInput<'a> {
    /// The tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// The chat template, or why there is none (said when a row needs one).
    pub template: Result<&'a ChatTemplate, String>,
    /// What the rows hold.
    pub format: Format,
    /// Which tokens the loss is on.
    pub loss_on: LossOn,
    /// The most tokens a row keeps (TRL's `max_length`), if any, and whether a longer row
    /// is left out (`--drop-long`) rather than cut to its first `max_length` tokens.
    pub max_length: Option<(usize, bool)>,
}

/// What was written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowsSummary {
    /// Conversations written.
    pub conversations: usize,
    /// Prompt/completion rows written.
    pub prompt_completions: usize,
    /// Plain texts written (rows of `text`, and the documents of text files).
    pub texts: usize,
    /// Rows with no token the loss is on (an empty assistant turn, or an answer a cut
    /// left out), left out.
    pub skipped: usize,
    /// Rows longer than `max_length`: cut to their start (TRL's default).
    pub truncated: usize,
    /// Rows longer than `max_length`, left out (`--drop-long`).
    pub dropped: usize,
}

/// Writes the rows of `files` (and the documents of any plain text file among them) into
/// a new token file of sequences at `path`, the last `valid_fraction` of its tokens held
/// out as whole sequences. A row that cannot be read or tokenized is an error naming the
/// file and the row; the file is then not written.
pub fn write_rows_token_file(
    files: &[PathBuf],
    input: &RowsInput<'_>,
    path: &Path,
    valid_fraction: f64,
) -> Result<(TokenFile, RowsSummary), FileError> {
    let tokenizer = input.tokenizer;
    let mut writer =
        TokenFileWriter::create(path, tokenizer.id_bound(), tokenizer.end_of_text()?.0, tokenizer.fingerprint())?;
    let mut summary = RowsSummary::default();
    let written = files.iter().try_for_each(|file| match is_rows_file(file) {
        true => write_rows(file, input, &mut writer, &mut summary),
        false => write_documents(file, tokenizer, &mut writer, &mut summary),
    });
    match written {
        Ok(()) => Ok((writer.finish(valid_fraction)?, summary)),
        Err(e) => {
            writer.abandon();
            Err(e)
        }
    }
}

/// The rows of one file, a batch at a time.
fn write_rows(
    file: &Path,
    input: &RowsInput<'_>,
    writer: &mut TokenFileWriter,
    summary: &mut RowsSummary,
) -> Result<(), FileError> {
    let label = if file.extension().is_some_and(|e| e == "jsonl") { "line" } else { "row" };
    let mut batch: Vec<(usize, Row)> = Vec::with_capacity(BATCH_ROWS);
    read_rows(file, input.format, |n, row| {
        batch.push((n, row));
        if batch.len() == BATCH_ROWS {
            flush(file, label, &mut batch, input, writer, summary)?;
        }
        Ok(())
    })?;
    flush(file, label, &mut batch, input, writer, summary)
}

/// Encodes `batch` on every core and writes it in order.
fn flush(
    file: &Path,
    label: &str,
    batch: &mut Vec<(usize, Row)>,
    input: &RowsInput<'_>,
    writer: &mut TokenFileWriter,
    summary: &mut RowsSummary,
) -> Result<(), FileError> {
    use rayon::prelude::*;
    let template = input.template.as_ref().copied().map_err(String::as_str);
    let samples: Vec<_> = batch
        .par_iter()
        .map(|(n, row)| {
            encode_row(row, input.tokenizer, template, input.loss_on)
                .map_err(|e| FileError::new(file, format!("{label} {n}: {e}")))
        })
        .collect();
    for ((_, row), sample) in batch.drain(..).zip(samples) {
        let mut sample = sample?;
        let closing = usize::from(sample.document && sample.ids.last() != Some(&writer.eos()));
        if let Some((max, drop)) = input.max_length
            && sample.ids.len() + closing > max
        {
            if drop {
                summary.dropped += 1;
                continue;
            }
            // A document keeps room for the end token that closes it.
            let keep = max.saturating_sub(usize::from(sample.document));
            sample.ids.truncate(keep);
            sample.mask.truncate(keep);
            summary.truncated += 1;
        }
        if sample.counted() == 0 {
            summary.skipped += 1;
            continue;
        }
        match &sample.document {
            true => writer.document(&sample.ids)?,
            false => writer.sequence(&sample.ids, &sample.mask)?,
        }
        match row {
            Row::Text(_) => summary.texts += 1,
            Row::Conversation { .. } => summary.conversations += 1,
            Row::PromptCompletion { .. } => summary.prompt_completions += 1,
        }
    }
    Ok(())
}

/// A plain text file's documents, each trained on whole.
fn write_documents(
    file: &Path,
    tokenizer: &Tokenizer,
    writer: &mut TokenFileWriter,
    summary: &mut RowsSummary,
) -> Result<(), FileError> {
    let before = writer.documents();
    Documents::new(&[file.to_path_buf()], "text").write_into(tokenizer, writer)?;
    summary.texts += writer.documents() - before;
    Ok(())
}
