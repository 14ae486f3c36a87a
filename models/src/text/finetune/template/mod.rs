//! Chat templates: a tokenizer's Jinja template rendered as `transformers`'
//! `apply_chat_template` renders it, with the assistant's spans its `{% generation %}`
//! blocks mark.
//!
//! # Note: what transformers adds to Jinja, and how it is met here
//! transformers compiles a template in a sandboxed Jinja environment with `trim_blocks`
//! and `lstrip_blocks` on, the loop controls (`break`, `continue`), a `tojson` filter that
//! is Python's `json.dumps` (non-ASCII kept, `", "` and `": "` between items), the globals
//! `raise_exception(message)` and `strftime_now(format)`, the special tokens
//! (`bos_token`, `eos_token`, ...) and `add_generation_prompt` in the context, and a
//! `{% generation %}` ... `{% endgeneration %}` tag whose output it records as the
//! assistant's characters. minijinja has all but the last two natively, Python's string and
//! dict methods through its contrib crate; it has no custom tags, so each generation tag
//! is rewritten before compiling into a block that prints a marker character (two from
//! Unicode's private use area) with the tag's own whitespace control, so that trimming
//! around it is what Jinja does around the original tag; the markers are then taken out
//! of the output, their places giving the spans.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use minijinja::value::{Serde, Value};
use minijinja::{Environment, Error, ErrorKind};

use self::python::{strftime_now, tojson};
use crate::file_error::FileError;

mod python;

/// Where a `{% generation %}` block starts and ends in the rendered text, before the
/// markers are taken out.
const START: char = '\u{E000}';
const END: char = '\u{E001}';

/// The template's name inside the environment (no extension: no auto-escaping, as
/// transformers renders).
const NAME: &str = "chat_template";

/// A compiled chat template, with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where it came from, for messages.
    origin: String,
    /// Whether it marks the assistant's turns (`{% generation %}`).
    marks_assistant: bool,
    /// `bos_token`, `eos_token`, ... as the tokenizer's config names them.
    special_tokens: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("origin", &self.origin).finish_non_exhaustive()
    }
}

/// A conversation rendered: its text, and the character ranges (Unicode scalar values, as
/// Python counts them) its `{% generation %}` blocks printed.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// What the template printed.
    pub text: String,
    /// The characters each `{% generation %}` block printed.
    pub generation: Vec<Range<usize>>,
}

impl ChatTemplate {
    /// The template `source`, from `origin` (a file, or a file and key, for messages),
    /// rendered with `special_tokens`. An error naming `origin` where it is not valid Jinja.
    pub fn new(source: &str, origin: &str, special_tokens: BTreeMap<String, String>) -> Result<Self, String> {
        let (rewritten, marks_assistant) = rewrite_generation_tags(source);
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| format!("{origin}: {e}"))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, rewritten)
            .map_err(|e| format!("{origin}: not a valid chat template: {}", describe(&e)))?;
        Ok(Self { env, origin: origin.to_string(), marks_assistant, special_tokens })
    }

    /// The template a tokenizer's files give, as transformers finds it: `chat_template.jinja`
    /// beside `tokenizer_file`, else the `chat_template` of the `tokenizer_config.json`
    /// beside it (a string, or a list of named templates: `name`'s, else `"default"`'s).
    /// The special tokens come from that config. An error naming the file where there is
    /// none, or it is not valid Jinja.
    pub fn beside(tokenizer_file: &Path, name: Option<&str>) -> Result<Self, FileError> {
        let config_path = tokenizer_file.with_file_name(crate::hf::TOKENIZER_CONFIG_FILE);
        let config = crate::file_error::read_optional_json(&config_path)?.unwrap_or(serde_json::Value::Null);
        let special = special_tokens(&config);
        let jinja = tokenizer_file.with_file_name("chat_template.jinja");
        if jinja.exists() && name.is_none() {
            return Self::from_file(&jinja, special);
        }
        let source = match (&config["chat_template"], name) {
            (serde_json::Value::String(s), None) => s.clone(),
            (serde_json::Value::Array(list), name) => {
                let wanted = name.unwrap_or("default");
                let found = list.iter().find(|t| t["name"] == wanted).and_then(|t| t["template"].as_str());
                let names: Vec<&str> = list.iter().filter_map(|t| t["name"].as_str()).collect();
                found
                    .ok_or_else(|| {
                        FileError::new(
                            &config_path,
                            format!("chat_template has no template named {wanted:?} (it has {names:?})"),
                        )
                    })?
                    .to_string()
            }
            (serde_json::Value::String(_), Some(name)) => {
                return Err(FileError::new(
                    &config_path,
                    format!("chat_template is one template, not a list of named ones: there is no {name:?}"),
                ));
            }
            _ => {
                return Err(FileError::new(
                    &config_path,
                    format!(
                        "no chat_template here, and no chat_template.jinja beside {}: give one with --chat-template FILE",
                        tokenizer_file.display()
                    ),
                ));
            }
        };
        Self::new(&source, &format!("{}: chat_template", config_path.display()), special)
            .map_err(|e| FileError::new(&config_path, e))
    }

    /// The template a run with the tokenizer `tokenizer_file` renders with: the file
    /// `given` (`--chat-template`), with the special tokens of the tokenizer's config, else
    /// the tokenizer's own ([`beside`](Self::beside)).
    pub fn for_tokenizer(tokenizer_file: &Path, given: Option<&Path>) -> Result<Self, FileError> {
        match given {
            Some(file) => Self::from_file(file, special_tokens_beside(tokenizer_file)?),
            None => Self::beside(tokenizer_file, None),
        }
    }

    /// The template in the file `path` (a `.jinja` file), rendered with `special_tokens`.
    pub fn from_file(path: &Path, special_tokens: BTreeMap<String, String>) -> Result<Self, FileError> {
        let bytes = crate::file_error::read_file(path)?;
        let source = String::from_utf8(bytes).map_err(|_| FileError::new(path, "not UTF-8 text"))?;
        Self::new(&source, &path.display().to_string(), special_tokens).map_err(|e| FileError::new(path, e))
    }

    /// Where it came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Whether it marks the assistant's turns with `{% generation %}` blocks.
    pub fn marks_assistant(&self) -> bool {
        self.marks_assistant
    }

    /// The special tokens it is rendered with.
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.special_tokens
    }

    /// `messages` (a JSON list of `{role, content, ...}`) rendered, with `tools` (a JSON
    /// list, or none) and the generation prompt if `add_generation_prompt`, and `extra`
    /// variables (a chat template's own keyword arguments, such as `enable_thinking`). An
    /// error with the template's message where it raises or fails.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Rendered, String> {
        if holds_marker(messages) {
            return Err(format!(
                "the conversation holds U+{:04X} or U+{:04X}, private-use characters zerotrain marks the template's \
                 generation blocks with",
                START as u32, END as u32
            ));
        }
        let mut context: BTreeMap<String, Value> =
            (self.special_tokens.iter()).map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect();
        for (k, v) in extra {
            context.insert(k.clone(), Value::from(Serde(v)));
        }
        context.insert("messages".into(), Value::from(Serde(messages)));
        context.insert("tools".into(), tools.map_or(Value::from(()), |t| Value::from(Serde(t))));
        context.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        let template = self.env.get_template(NAME).map_err(|e| describe(&e))?;
        let out = template.render(Value::from(Serde(&context))).map_err(|e| describe(&e))?;
        take_markers(&out)
    }
}

/// Whether a string of `value` (a key or a value, at any depth) holds a marker character.
fn holds_marker(value: &serde_json::Value) -> bool {
    use serde_json::Value as J;
    let marked = |s: &str| s.contains([START, END]);
    match value {
        J::String(s) => marked(s),
        J::Array(items) => items.iter().any(holds_marker),
        J::Object(map) => map.iter().any(|(k, v)| marked(k) || holds_marker(v)),
        _ => false,
    }
}

/// A template error as a person reads it: the template's own message for
/// `raise_exception`, else minijinja's with the line.
fn describe(e: &Error) -> String {
    match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(detail)) if detail.starts_with(RAISED) => detail[RAISED.len()..].to_string(),
        _ => match e.line() {
            Some(line) => format!("{e} (line {line})"),
            None => e.to_string(),
        },
    }
}

/// The prefix of a message `raise_exception` gave (told apart from minijinja's own).
const RAISED: &str = "raised: ";

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{message}")))
}

/// `{% generation %}` and `{% endgeneration %}` (with any whitespace control) rewritten as
/// blocks printing the markers; whether there were any.
fn rewrite_generation_tags(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        match parse_tag(tag) {
            Some((len, left, end, right)) => {
                let marker = if end { END } else { START };
                out.push_str(&format!("{{%{left} if true %}}{{{{ \"{marker}\" }}}}{{% endif {right}%}}"));
                rest = &tag[len..];
                found = true;
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    (out, found)
}

/// A generation tag at the start of `tag`: its length, its left and right whitespace
/// controls, and whether it is the end tag.
fn parse_tag(tag: &str) -> Option<(usize, &str, bool, &str)> {
    let body = &tag[2..];
    let (left, body) = match body.as_bytes().first() {
        Some(b'-' | b'+') => (&body[..1], &body[1..]),
        _ => ("", body),
    };
    let trimmed = body.trim_start();
    let (end, after) = if let Some(after) = trimmed.strip_prefix("endgeneration") {
        (true, after)
    } else {
        (false, trimmed.strip_prefix("generation")?)
    };
    let after_name = after.trim_start();
    if after.len() == after_name.len() && !after.starts_with(['-', '+', '%']) {
        return None; // `{% generations %}` or the like
    }
    let (right, close) = match after_name.as_bytes().first() {
        Some(b'-' | b'+') => (&after_name[..1], &after_name[1..]),
        _ => ("", after_name),
    };
    let close = close.strip_prefix("%}")?;
    Some((tag.len() - close.len(), left, end, right))
}

/// The rendered text without its markers, and the character spans between them.
fn take_markers(out: &str) -> Result<Rendered, String> {
    let mut text = String::with_capacity(out.len());
    let (mut chars, mut open, mut generation) = (0usize, None, Vec::new());
    for c in out.chars() {
        match c {
            START if open.is_none() => open = Some(chars),
            END => match open.take() {
                Some(start) => generation.push(start..chars),
                None => return Err("the template ends a generation block it did not start".into()),
            },
            START => return Err("the template starts a generation block inside another".into()),
            c => {
                text.push(c);
                chars += 1;
            }
        }
    }
    if open.is_some() {
        return Err("the template leaves a generation block open".into());
    }
    Ok(Rendered { text, generation })
}

/// The special tokens of the `tokenizer_config.json` beside `tokenizer_file` (none where
/// there is no such file), for a template given apart (`--chat-template`).
fn special_tokens_beside(tokenizer_file: &Path) -> Result<BTreeMap<String, String>, FileError> {
    let config = tokenizer_file.with_file_name(crate::hf::TOKENIZER_CONFIG_FILE);
    Ok(crate::file_error::read_optional_json(&config)?.map(|c| special_tokens(&c)).unwrap_or_default())
}

/// The special tokens of a `tokenizer_config.json` (strings, or `{"content": ...}`), as
/// transformers passes its `special_tokens_map` to a template.
fn special_tokens(config: &serde_json::Value) -> BTreeMap<String, String> {
    const NAMES: [&str; 7] =
        ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];
    let text = |v: &serde_json::Value| v.as_str().or_else(|| v["content"].as_str()).map(str::to_string);
    NAMES.iter().filter_map(|&n| Some((n.to_string(), text(&config[n])?))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: serde_json::Value) -> Result<Rendered, String> {
        ChatTemplate::new(source, "test", BTreeMap::new())?.render(&messages, None, false, &Default::default())
    }

    /// The generation tags become spans, with their whitespace control as Jinja applies it
    /// (trim_blocks and lstrip_blocks on); a tag-like word that is not one stays text.
    #[test]
    fn generation_blocks_give_character_spans() {
        let source = "{% for m in messages %}\n  {%- if m.role == 'assistant' %}[{% generation %}{{ m.content }}é{% endgeneration %}]\n{%- else %}<{{ m.content }}>\n{% endif %}{% endfor %}";
        let got = render(
            source,
            serde_json::json!([{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]),
        )
        .unwrap();
        assert_eq!(got.text, "<ab>\n[cdé]");
        assert_eq!(got.generation, vec![6..9]);
        assert!(!rewrite_generation_tags("{% generations %}").1);
        let (_, found) = rewrite_generation_tags("{%- generation -%}x{%+endgeneration%}");
        assert!(found);
    }

    /// `raise_exception` gives the template's own message; an invalid template names its
    /// origin.
    #[test]
    fn raising_and_invalid_templates_are_errors_in_words() {
        let err = render("{{ raise_exception('roles must alternate') }}", serde_json::json!([])).unwrap_err();
        assert_eq!(err, "roles must alternate");
        let err = ChatTemplate::new("{% for %}", "here.jinja", BTreeMap::new()).unwrap_err();
        assert!(err.starts_with("here.jinja: not a valid chat template"), "{err}");
        let err = render("{% generation %}open", serde_json::json!([])).unwrap_err();
        assert!(err.contains("open"), "{err}");
    }

    /// A conversation holding a marker character is refused, not rendered with a wrong span.
    #[test]
    fn a_conversation_holding_a_marker_is_refused() {
        let source = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}";
        for messages in [
            serde_json::json!([{"role": "assistant", "content": "a\u{E001}b"}]),
            serde_json::json!([{"role": "assistant", "content": "ok", "name\u{E000}": 1}]),
        ] {
            let err = render(source, messages).unwrap_err();
            assert!(err.contains("U+E000"), "{err}");
        }
        assert!(render(source, serde_json::json!([{"role": "assistant", "content": "ok"}])).is_ok());
    }
}
