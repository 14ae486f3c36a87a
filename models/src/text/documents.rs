//! The documents of a corpus's files, read a batch at a time ([`Documents`]): a text file's
//! blank-line-separated paragraphs, or a JSON-lines file's lines (a string field of each),
//! so that tokenizing never holds more of the corpus than a batch and the document being
//! read.

use std::fs::File;
use std::io::{BufRead, BufReader, Lines, Read};
use std::path::{Path, PathBuf};

use super::Tokenizer;
use super::tokens::{TokenFile, TokenFileWriter};
use crate::file_error::FileError;

/// Bytes read from a text file at a time.
const CHUNK: usize = 1 << 20;
/// Text encoded at a time by [`Documents::encode_into`] (and at most [`BATCH_DOCUMENTS`]
/// documents).
const BATCH_BYTES: usize = 8 << 20;
/// Documents encoded at a time, in parallel.
const BATCH_DOCUMENTS: usize = 4096;

/// The documents of a list of files, in order.
pub struct Documents {
    files: std::collections::VecDeque<PathBuf>,
    field: String,
    open: Option<Open>,
}

/// The file being read.
enum Open {
    /// Paragraphs: the text between blank lines (`\n\n`, or `\r\n\r\n` in a file with
    /// Windows line ends), the line end before the blank line not included (a paragraph of
    /// whitespace alone is no document).
    Text(TextFile),
    /// A JSON-lines file: a document per non-blank line, its `field`.
    Lines { path: PathBuf, lines: Lines<BufReader<File>>, number: usize },
}

/// A text file being cut into paragraphs.
struct TextFile {
    path: PathBuf,
    file: File,
    /// Bytes read and not dropped yet; `pending[start..]` is not cut yet, and holds no
    /// blank line before `searched`.
    pending: Vec<u8>,
    start: usize,
    searched: usize,
    /// The file's offset of `pending[0]`.
    offset: u64,
    at_end: bool,
}

impl Documents {
    /// The documents of `files` (text files, or `.jsonl` / `.ndjson` files whose lines hold
    /// their text in `field`), read as they are asked for.
    pub fn new(files: &[PathBuf], field: &str) -> Self {
        Self { files: files.iter().cloned().collect(), field: field.to_string(), open: None }
    }

    /// The next documents, at least one unless the files are done, until they hold
    /// `bytes` of text or number `count`.
    pub fn batch(&mut self, bytes: usize, count: usize) -> Result<Vec<String>, FileError> {
        let (mut batch, mut held) = (Vec::new(), 0);
        while held < bytes && batch.len() < count {
            let Some(document) = self.next().transpose()? else { break };
            held += document.len();
            batch.push(document);
        }
        Ok(batch)
    }

    /// Writes every document, as `tokenizer` encodes a document, into a new token file at
    /// `path` (the last `valid_fraction` of its tokens held out), a batch at a time: a
    /// batch's documents are encoded in parallel and written in order. A file that fails
    /// part-way leaves nothing at `path`. The file, and the bytes of text read.
    pub fn write_token_file(
        self,
        tokenizer: &Tokenizer,
        path: &Path,
        valid_fraction: f64,
    ) -> Result<(TokenFile, usize), FileError> {
        let mut writer =
            TokenFileWriter::create(path, tokenizer.id_bound(), tokenizer.end_of_text()?.0, tokenizer.fingerprint())?;
        match self.write_into(tokenizer, &mut writer) {
            Ok(text_bytes) => Ok((writer.finish(valid_fraction)?, text_bytes)),
            Err(e) => {
                writer.abandon();
                Err(e)
            }
        }
    }

    /// Writes every document into `writer` as [`write_token_file`](Self::write_token_file)
    /// does (a batch at a time, encoded in parallel, written in order); the bytes of text
    /// read.
    pub fn write_into(mut self, tokenizer: &Tokenizer, writer: &mut TokenFileWriter) -> Result<usize, FileError> {
        use rayon::prelude::*;
        let mut text_bytes = 0;
        loop {
            let batch = self.batch(BATCH_BYTES, BATCH_DOCUMENTS)?;
            if batch.is_empty() {
                return Ok(text_bytes);
            }
            text_bytes += batch.iter().map(String::len).sum::<usize>();
            let ids = batch.par_iter().map(|d| tokenizer.encode_document(d)).collect::<Result<Vec<_>, _>>()?;
            ids.iter().try_for_each(|doc| writer.document(doc))?;
        }
    }
}

impl Iterator for Documents {
    type Item = Result<String, FileError>;

    /// The next document of the file being read, opening the next file where one ends.
    fn next(&mut self) -> Option<Result<String, FileError>> {
        loop {
            if self.open.is_none() {
                let path = self.files.pop_front()?;
                self.open = match open(&path) {
                    Ok(open) => Some(open),
                    Err(e) => return Some(Err(e)),
                };
            }
            let open = self.open.as_mut().expect("opened above");
            match open.next(&self.field) {
                Ok(Some(document)) => return Some(Ok(document)),
                Ok(None) => self.open = None,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

fn open(path: &Path) -> Result<Open, FileError> {
    let file =
        zerotrain_checkpoint::open_regular(path).map_err(|e| FileError::new(path, format!("cannot open it: {e}")))?;
    let jsonl = path.extension().is_some_and(|e| e == "jsonl" || e == "ndjson");
    let path = path.to_path_buf();
    Ok(match jsonl {
        true => Open::Lines { path, lines: BufReader::new(file).lines(), number: 0 },
        false => {
            Open::Text(TextFile { path, file, pending: Vec::new(), start: 0, searched: 0, offset: 0, at_end: false })
        }
    })
}

impl Open {
    /// The next document of this file, `None` at its end.
    fn next(&mut self, field: &str) -> Result<Option<String>, FileError> {
        match self {
            Open::Text(text) => text.next(),
            Open::Lines { path, lines, number } => loop {
                let Some(line) = lines.next() else { return Ok(None) };
                *number += 1;
                let line = line.map_err(|e| FileError::new(path, format!("cannot read line {number}: {e}")))?;
                if line.trim().is_empty() {
                    continue;
                }
                let value: serde_json::Value = serde_json::from_str(&line)
                    .map_err(|e| FileError::new(path, format!("line {number}: not JSON: {e}")))?;
                return match value.get(field) {
                    Some(serde_json::Value::String(text)) => Ok(Some(text.clone())),
                    _ => Err(FileError::new(
                        path,
                        format!("line {number}: no string field `{field}` (choose it with --field)"),
                    )),
                };
            },
        }
    }
}

/// The first blank line in `bytes` from `from`: (where the line end before it starts, the
/// bytes to skip), for `\n\n` and `\n\r\n`. A `\n\r` at the very end is not decided
/// until more is read (unless `at_end`).
fn blank_line(bytes: &[u8], from: usize, at_end: bool) -> Option<(usize, usize)> {
    let n = bytes.len();
    (from..n.saturating_sub(1)).find_map(|i| match (bytes[i], bytes[i + 1], bytes.get(i + 2)) {
        (b'\n', b'\n', _) => Some(Some((i, 2))),
        (b'\n', b'\r', Some(b'\n')) => Some(Some((i, 3))),
        (b'\n', b'\r', None) if !at_end => Some(None),
        _ => None,
    })?
}

impl TextFile {
    /// The next paragraph holding more than whitespace, `None` at the file's end.
    fn next(&mut self) -> Result<Option<String>, FileError> {
        loop {
            let from = self.searched.min(self.pending.len());
            let cut = blank_line(&self.pending, from, self.at_end);
            let (end, next) = match cut {
                Some((cut, len)) => (cut, cut + len),
                None if self.at_end && self.start < self.pending.len() => (self.pending.len(), self.pending.len()),
                None if self.at_end => return Ok(None),
                None => {
                    self.read()?;
                    continue;
                }
            };
            let (start, mut bytes) = (self.start, &self.pending[self.start..end]);
            if let [rest @ .., b'\r'] = bytes {
                bytes = rest; // a Windows line end before the blank line
            }
            (self.start, self.searched) = (next, next);
            let text = std::str::from_utf8(bytes).map_err(|e| {
                let at = self.offset + start as u64;
                FileError::new(&self.path, format!("not UTF-8 text: {e} in the paragraph from byte {at}"))
            })?;
            if !text.trim().is_empty() {
                return Ok(Some(text.to_string()));
            }
        }
    }

    /// Drops what is cut and reads on (a blank line may span the seam).
    fn read(&mut self) -> Result<(), FileError> {
        let start = self.start.min(self.pending.len());
        self.pending.drain(..start);
        self.offset += start as u64;
        (self.start, self.searched) = (0, self.pending.len().saturating_sub(2));
        let read = (&mut self.file)
            .take(CHUNK as u64)
            .read_to_end(&mut self.pending)
            .map_err(|e| FileError::new(&self.path, format!("cannot read it: {e}")))?;
        self.at_end = read == 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every document, read in batches of `bytes`.
    fn all(files: &[PathBuf], bytes: usize) -> Result<Vec<String>, FileError> {
        let mut documents = Documents::new(files, "text");
        let mut out = Vec::new();
        loop {
            let batch = documents.batch(bytes, 3)?;
            if batch.is_empty() {
                return Ok(out);
            }
            out.extend(batch);
        }
    }

    /// Paragraphs are `str::split("\n\n")`'s, whitespace-only ones dropped, wherever the
    /// reads fall (a text longer than a read, a `\n\n` across two reads); lines of JSON give
    /// their field; the files follow each other.
    #[test]
    fn documents_are_the_paragraphs_and_lines_of_the_files_in_order() {
        let dir = std::env::temp_dir().join(format!("zerotrain-documents-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut text = String::from("a\n\n\nb\n\n\n\nc d\n \n\n  \n\n\u{e9}t\u{e9}\n\n");
        let mut state = 7u64;
        while text.len() < 3 * CHUNK + 5 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            text.push_str(["word ", "\n", "\n\n", "\u{6771}", " \n\n\n"][(state >> 61) as usize % 5]);
        }
        text.push_str("last");
        let (plain, lines) = (dir.join("t.txt"), dir.join("t.jsonl"));
        std::fs::write(&plain, &text).unwrap();
        std::fs::write(&lines, "{\"text\": \"one\"}\n\n{\"text\": \"two\\n\\nthree\", \"id\": 2}\n").unwrap();
        let expected: Vec<String> = text.split("\n\n").filter(|d| !d.trim().is_empty()).map(String::from).collect();
        assert!(expected.len() > 1000);
        for bytes in [1, 100, 1 << 30] {
            let got = all(&[plain.clone(), lines.clone(), plain.clone()], bytes).unwrap();
            let want = [&expected[..], &["one".to_string(), "two\n\nthree".to_string()], &expected[..]].concat();
            assert!(got == want, "batches of {bytes} bytes: {} documents, not {}", got.len(), want.len());
        }
        std::fs::write(&lines, "{\"text\": \"one\"}\n{\"body\": \"two\"}\n").unwrap();
        let err = all(std::slice::from_ref(&lines), 1).unwrap_err().to_string();
        assert!(err.contains("t.jsonl: line 2: no string field `text`"), "{err}");
        std::fs::write(&lines, "{\"text\": \"one\"}\nnot json\n").unwrap();
        assert!(all(std::slice::from_ref(&lines), 1).unwrap_err().to_string().contains("line 2: not JSON"));
        std::fs::write(&plain, b"fine\n\nbad \xff byte\n\nfine").unwrap();
        assert!(all(std::slice::from_ref(&plain), 1).unwrap_err().to_string().contains("t.txt: not UTF-8 text"));
        let err = all(&[dir.join("missing.txt")], 1).unwrap_err().to_string();
        assert!(err.contains("missing.txt: cannot open it"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file with Windows line ends is cut at its blank lines too (`\r\n\r\n`; it was once
    /// one document, held whole, with one end token), the line end before each blank line
    /// left out, lines inside a paragraph kept as written, across reads.
    #[test]
    fn windows_line_ends_cut_paragraphs_too() {
        let dir = std::env::temp_dir().join(format!("zerotrain-documents-crlf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let paragraph =
            |i: usize| format!("paragraph {i} line one\r\nand its second line {}", "x".repeat(5000 + i % 3000));
        let text: String = (0..400).map(|i| paragraph(i) + "\r\n\r\n").collect();
        assert!(text.len() > 2 * CHUNK);
        let path = dir.join("crlf.txt");
        std::fs::write(&path, format!("{text}\r\n\n{}", paragraph(400))).unwrap();
        let got = all(&[path], 1 << 30).unwrap();
        let expected: Vec<String> = (0..=400).map(paragraph).collect();
        assert_eq!(got.len(), 401);
        assert!(got == expected, "the paragraphs of a CRLF text, without their last line end");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
