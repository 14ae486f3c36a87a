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

use minijinja::value::{Kwargs, Serde, Value};
use minijinja::{Environment, Error, ErrorKind};

use crate::file_error::FileError;

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
        let check = serde_json::to_string(messages).unwrap_or_default();
        if check.contains(START) || check.contains(END) {
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
pub fn special_tokens_beside(tokenizer_file: &Path) -> Result<BTreeMap<String, String>, FileError> {
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

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, each keyword taken.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match &indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (_, Some(s)) => Some(s.to_string()),
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent must be a number or a string")),
        },
    };
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")),
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let style = PyJson { ascii: ensure_ascii.unwrap_or(false), indent, item, key, sort: sort_keys.unwrap_or(false) };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(out)
}

/// How Python's `json.dumps` lays a value out.
struct PyJson {
    ascii: bool,
    indent: Option<String>,
    item: String,
    key: String,
    sort: bool,
}

impl PyJson {
    fn write(&self, v: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => out.push_str(&python_number(n)),
            J::String(s) => self.string(s, out),
            J::Array(items) if items.is_empty() => out.push_str("[]"),
            J::Object(map) if map.is_empty() => out.push_str("{}"),
            J::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.write(item, depth + 1, out);
                }
                self.close(depth, out);
                out.push(']');
            }
            J::Object(map) => {
                out.push('{');
                let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
                if self.sort {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(item, depth + 1, out);
                }
                self.close(depth, out);
                out.push('}');
            }
        }
    }

    /// What goes before item `i` of a container at `depth`.
    fn separate(&self, i: usize, depth: usize, out: &mut String) {
        if i > 0 {
            out.push_str(&self.item);
        }
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
    }

    fn close(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A JSON number as Python prints it: integers as they are, floats by their shortest
/// representation with Python's `repr` exponent form (`1e-07`, `1e+20`).
fn python_number(n: &serde_json::Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    let f = n.as_f64().unwrap_or(f64::NAN);
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        let s = format!("{f:e}"); // `1e-7`, `1.5e20`
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let mantissa = mantissa.strip_suffix(".0").unwrap_or(mantissa);
        return format!("{mantissa}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    let s = format!("{f}");
    if s.contains('.') || s.contains("inf") || s.contains("NaN") { s } else { format!("{s}.0") }
}

/// transformers' `strftime_now(format)`: the time now (UTC here) through C's `strftime`,
/// for the codes templates use (`%d %b %Y` in LLaMA 3.1's); another code is an error
/// naming it.
fn strftime_now(format: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    strftime(&format, secs)
}

/// `format` at `secs` seconds after the Unix epoch (UTC).
fn strftime(format: &str, secs: i64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (year, month, day) = civil_from_days(days);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[month as usize - 1];
    let (h, m, s) = (rem / 3600, rem / 60 % 60, rem % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: %{} is not one of the codes zerotrain formats",
                        other.map_or(String::new(), String::from)
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// (year, month 1-12, day 1-31) of day `days` after 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
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

    /// `tojson` prints what Python's `json.dumps` prints (the strings here are Python's own
    /// output for the same values).
    #[test]
    fn tojson_is_pythons_json_dumps() {
        let v = serde_json::json!({"b": [1, 2.5, null, true], "a": "Zürich \"x\"\n", "c": {}, "d": 1e-7, "e": 1e20});
        let cases = [
            (
                "{{ v | tojson }}",
                r#"{"b": [1, 2.5, null, true], "a": "Zürich \"x\"\n", "c": {}, "d": 1e-07, "e": 1e+20}"#,
            ),
            (
                "{{ v | tojson(sort_keys=true) }}",
                r#"{"a": "Zürich \"x\"\n", "b": [1, 2.5, null, true], "c": {}, "d": 1e-07, "e": 1e+20}"#,
            ),
            ("{{ v.b | tojson(indent=2) }}", "[\n  1,\n  2.5,\n  null,\n  true\n]"),
            ("{{ v.a | tojson(ensure_ascii=true) }}", r#""Z\u00fcrich \"x\"\n""#),
            ("{{ v.b | tojson(separators=[',', ':']) }}", "[1,2.5,null,true]"),
        ];
        for (source, want) in cases {
            let t = ChatTemplate::new(source, "t", BTreeMap::new()).unwrap();
            let mut extra = serde_json::Map::new();
            extra.insert("v".into(), v.clone());
            assert_eq!(t.render(&serde_json::json!([]), None, false, &extra).unwrap().text, want, "{source}");
        }
    }

    /// `strftime` against dates worked out by hand (2024-02-29 was a Thursday).
    #[test]
    fn strftime_formats_the_codes_templates_use() {
        let leap_day = 19_782 * 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(strftime("%d %b %Y", leap_day).unwrap(), "29 Feb 2024");
        assert_eq!(strftime("%A %B %e, %y %H:%M:%S %%", leap_day).unwrap(), "Thursday February 29, 24 13:05:09 %");
        assert_eq!(strftime("%d %m %Y", 0).unwrap(), "01 01 1970");
        assert!(strftime("%Q", 0).unwrap_err().to_string().contains("%Q"));
    }
}
