//! The rows of a fine-tuning file: JSON lines (`.jsonl`), a JSON list of rows (`.json`) or
//! Parquet (`.parquet`, as Hugging Face datasets ship them), each a plain `text`, a conversation (`messages`, with `tools` optionally), or a
//! `prompt` and its `completion` (two strings, or two message lists as TRL takes them).
//! A row without the columns its format needs is refused naming the file, the row and the
//! column.

use std::io::BufRead;
use std::path::Path;

use serde_json::Value;

use crate::file_error::FileError;

/// One row.
#[derive(Debug, Clone, PartialEq)]
pub enum Row {
    /// A document (`text`), trained on whole as a plain corpus is.
    Text(String),
    /// A conversation: `messages` (a list of `{role, content, ...}`) and the `tools` the
    /// template may list.
    Conversation {
        /// The messages, each an object with a `role` and a `content`.
        messages: Value,
        /// The functions offered (a list), if any.
        tools: Option<Value>,
    },
    /// A prompt and the completion that follows it.
    PromptCompletion {
        /// What the model reads.
        prompt: Part,
        /// What it learns to write after it.
        completion: Part,
        /// The functions offered (a list), if any.
        tools: Option<Value>,
    },
}

/// A prompt's or a completion's content: a string, or messages (rendered by the template).
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// A string.
    Text(String),
    /// A list of messages.
    Messages(Value),
}

/// What the rows hold: whatever columns each has, or one kind for all (`--format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// `messages` if the row has them, else `prompt` and `completion`, else `text`.
    #[default]
    Auto,
    /// `text` in every row.
    Text,
    /// `messages` in every row.
    Messages,
    /// `prompt` and `completion` in every row.
    PromptCompletion,
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "text" => Ok(Self::Text),
            "messages" => Ok(Self::Messages),
            "prompt-completion" => Ok(Self::PromptCompletion),
            _ => Err(format!("{s:?} is not a format: auto, text, messages or prompt-completion")),
        }
    }
}

/// Whether `path` names a file of rows (`.jsonl`, `.json`, `.parquet`) rather than plain
/// text.
pub fn is_rows_file(path: &Path) -> bool {
    matches!(path.extension().and_then(|e| e.to_str()), Some("jsonl" | "json" | "parquet"))
}

/// Calls `each` with every row of `path` (`.jsonl`: one JSON object a line, blank lines
/// skipped; `.json`: a list of objects; `.parquet`: its rows, read a row group at a time,
/// strings, lists and structs as JSON's) and its number (the line of a `.jsonl` file, the
/// place of the row otherwise, from 1), read as `format` says; stops at the first error,
/// `each`'s or a row's.
pub fn read_rows(
    path: &Path,
    format: Format,
    mut each: impl FnMut(usize, Row) -> Result<(), FileError>,
) -> Result<(), FileError> {
    let io = |e: std::io::Error| FileError::new(path, format!("cannot read it: {e}"));
    // Only a regular file: a FIFO's open would wait for a writer, a device never end.
    let file =
        zerotrain_checkpoint::open_regular(path).map_err(|e| FileError::new(path, format!("cannot open it: {e}")))?;
    match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl") => {
            for (i, line) in std::io::BufReader::with_capacity(1 << 20, file).lines().enumerate() {
                let line = line.map_err(io)?;
                if line.trim().is_empty() {
                    continue;
                }
                let at = format!("line {}", i + 1);
                let value: Value = serde_json::from_str(&line)
                    .map_err(|e| FileError::new(path, format!("{at}: not a JSON object: {e}")))?;
                each(i + 1, row(value, format).map_err(|e| FileError::new(path, format!("{at}: {e}")))?)?;
            }
            Ok(())
        }
        Some("json") => {
            let value: Value = serde_json::from_reader(std::io::BufReader::new(file))
                .map_err(|e| FileError::new(path, format!("not JSON: {e}")))?;
            let Value::Array(rows) = value else {
                return Err(FileError::new(path, "a .json file of rows is a list of objects; this is not a list"));
            };
            for (i, value) in rows.into_iter().enumerate() {
                let at = format!("row {}", i + 1);
                each(i + 1, row(value, format).map_err(|e| FileError::new(path, format!("{at}: {e}")))?)?;
            }
            Ok(())
        }
        Some("parquet") => {
            use parquet::file::reader::SerializedFileReader;
            let parquet_error =
                |e: parquet::errors::ParquetError| FileError::new(path, format!("not a readable Parquet file: {e}"));
            let reader = SerializedFileReader::new(file).map_err(parquet_error)?;
            let rows = parquet::record::reader::RowIter::from_file_into(Box::new(reader));
            for (i, record) in rows.enumerate() {
                let at = format!("row {}", i + 1);
                let record = record.map_err(|e| FileError::new(path, format!("{at}: cannot read it: {e}")))?;
                each(
                    i + 1,
                    row(record.to_json_value(), format).map_err(|e| FileError::new(path, format!("{at}: {e}")))?,
                )?;
            }
            Ok(())
        }
        _ => Err(FileError::new(path, "rows are read from .jsonl, .json or .parquet files")),
    }
}

/// One row from its JSON object.
fn row(value: Value, format: Format) -> Result<Row, String> {
    let Value::Object(mut map) = value else { return Err("not a JSON object".into()) };
    let has = |k: &str| map.get(k).is_some_and(|v| !v.is_null());
    let kind = match format {
        Format::Auto if has("messages") => Format::Messages,
        Format::Auto if has("prompt") || has("completion") => Format::PromptCompletion,
        Format::Auto if has("text") => Format::Text,
        Format::Auto => {
            let columns: Vec<&String> = map.keys().collect();
            return Err(format!(
                "none of the columns a row needs: `text`, `messages`, or `prompt` and `completion` (it has {columns:?})"
            ));
        }
        f => f,
    };
    let tools = match map.remove("tools") {
        None | Some(Value::Null) => None,
        // TRL takes tools written as a JSON string too.
        Some(Value::String(s)) => {
            Some(serde_json::from_str(&s).map_err(|e| format!("column `tools`: a string that is not JSON: {e}"))?)
        }
        Some(v @ Value::Array(_)) => Some(v),
        Some(_) => return Err("column `tools`: not a list".into()),
    };
    let mut take =
        |column: &str| map.remove(column).filter(|v| !v.is_null()).ok_or_else(|| format!("no column `{column}`"));
    match kind {
        Format::Text => match take("text")? {
            Value::String(s) => Ok(Row::Text(s)),
            _ => Err("column `text`: not a string".into()),
        },
        Format::Messages => Ok(Row::Conversation { messages: messages(take("messages")?, "messages")?, tools }),
        Format::PromptCompletion => {
            let (prompt, completion) = (take("prompt")?, take("completion")?);
            let part = |v: Value, column: &str| match v {
                Value::String(s) => Ok(Part::Text(s)),
                v @ Value::Array(_) => Ok(Part::Messages(messages(v, column)?)),
                _ => Err(format!("column `{column}`: neither a string nor a list of messages")),
            };
            let (prompt, completion) = (part(prompt, "prompt")?, part(completion, "completion")?);
            if matches!(prompt, Part::Text(_)) != matches!(completion, Part::Text(_)) {
                return Err("columns `prompt` and `completion`: one is a string and the other messages; give both \
                            as strings or both as message lists"
                    .into());
            }
            Ok(Row::PromptCompletion { prompt, completion, tools })
        }
        Format::Auto => unreachable!("resolved above"),
    }
}

/// `value` checked as a list of messages for column `column`: objects with a string
/// `role`, and a `content` that is a string (or null, or absent, beside `tool_calls`).
fn messages(value: Value, column: &str) -> Result<Value, String> {
    let Value::Array(list) = &value else { return Err(format!("column `{column}`: not a list of messages")) };
    if list.is_empty() {
        return Err(format!("column `{column}`: no messages"));
    }
    for (i, m) in list.iter().enumerate() {
        let at = format!("column `{column}`, message {}", i + 1);
        let Value::Object(m) = m else { return Err(format!("{at}: not an object with a role and a content")) };
        match m.get("role") {
            Some(Value::String(r)) if !r.is_empty() => {}
            Some(_) => return Err(format!("{at}: `role` is not a role's name")),
            None => return Err(format!("{at}: no `role`")),
        }
        match m.get("content") {
            Some(Value::String(_) | Value::Null) => {}
            None if m.contains_key("tool_calls") => {}
            None => return Err(format!("{at}: no `content`")),
            Some(Value::Array(_)) => {
                return Err(format!("{at}: `content` is a list of parts (images, ...); only text content is built"));
            }
            Some(_) => return Err(format!("{at}: `content` is not a string")),
        }
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows_of(name: &str, body: &str, format: Format) -> Result<Vec<(usize, Row)>, String> {
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("zt-rows-{}-{call}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        let mut out = Vec::new();
        let result = read_rows(&path, format, |i, r| {
            out.push((i, r));
            Ok(())
        });
        std::fs::remove_dir_all(&dir).unwrap();
        result.map(|_| out).map_err(|e| e.to_string())
    }

    /// Each kind of row from JSON lines and from a JSON list, by its columns; tools as a list
    /// or a JSON string.
    #[test]
    fn rows_are_read_by_their_columns() {
        let body = r#"{"text": "plain"}

{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "tools": "[{\"name\": \"f\"}]"}
{"prompt": "2+2=", "completion": "4"}
{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}"#;
        let rows = rows_of("a.jsonl", body, Format::Auto).unwrap();
        assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 3, 4, 5]);
        assert_eq!(rows[0].1, Row::Text("plain".into()));
        let Row::Conversation { messages, tools } = &rows[1].1 else { panic!("{:?}", rows[1]) };
        assert_eq!((messages.as_array().unwrap().len(), tools), (2, &Some(serde_json::json!([{"name": "f"}]))));
        assert!(
            matches!(&rows[2].1, Row::PromptCompletion { prompt: Part::Text(p), completion: Part::Text(c), .. } if p == "2+2=" && c == "4")
        );
        assert!(matches!(&rows[3].1, Row::PromptCompletion { prompt: Part::Messages(_), .. }));
        let list = rows_of("b.json", r#"[{"text": "x"}, {"text": "y"}]"#, Format::Text).unwrap();
        assert_eq!(list.len(), 2);
    }

    /// A row without what its format needs names the file, the row and the column.
    #[test]
    fn bad_rows_name_the_row_and_the_column() {
        let cases = [
            ("a.jsonl", "{\"text\": \"ok\"}\n{\"txt\": \"no\"}", Format::Auto, "line 2: none of the columns"),
            ("b.jsonl", r#"{"text": "ok"}"#, Format::Messages, "line 1: no column `messages`"),
            (
                "c.json",
                r#"[{"messages": [{"content": "x"}]}]"#,
                Format::Auto,
                "row 1: column `messages`, message 1: no `role`",
            ),
            ("d.json", r#"[{"messages": []}]"#, Format::Auto, "row 1: column `messages`: no messages"),
            (
                "e.jsonl",
                r#"{"prompt": "p", "completion": [{"role": "assistant", "content": "a"}]}"#,
                Format::Auto,
                "one is a string",
            ),
            (
                "f.jsonl",
                r#"{"messages": [{"role": "user", "content": [{"type": "image"}]}]}"#,
                Format::Auto,
                "list of parts",
            ),
            ("g.jsonl", "{not json", Format::Auto, "line 1: not a JSON object"),
            ("h.json", r#"{"text": "x"}"#, Format::Auto, "is a list of objects"),
            ("i.jsonl", r#"{"text": 3}"#, Format::Auto, "column `text`: not a string"),
        ];
        for (name, body, format, want) in cases {
            let err = rows_of(name, body, format).unwrap_err();
            assert!(err.contains(name) && err.contains(want), "{name}: {err}");
        }
    }

    /// Parquet files as Hugging Face datasets write them (pyarrow: snappy in two row groups,
    /// zstd; `bench/reference/parquet_rows.py`) give the rows the same rows as JSON lines
    /// give; a `messages` column of strings is refused naming the row and the column.
    #[test]
    fn parquet_rows_read_as_their_json_lines() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/reference/chat_rows");
        let read = |name: &str| {
            let mut out = Vec::new();
            read_rows(&dir.join(name), Format::Auto, |_, r| {
                out.push(r);
                Ok(())
            })
            .map(|_| out)
            .map_err(|e| e.to_string())
        };
        let lines = read("rows.jsonl").unwrap();
        let parquet = [read("conversations.parquet").unwrap(), read("completions.parquet").unwrap()].concat();
        assert_eq!(parquet.len(), 5);
        assert_eq!(parquet, lines);
        let err = read("bad.parquet").unwrap_err();
        assert!(err.contains("bad.parquet") && err.contains("row 1: column `messages`: not a list"), "{err}");
    }
}
