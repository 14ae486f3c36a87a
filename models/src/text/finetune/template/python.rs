//! The Python functions transformers gives a chat template: `tojson` (Python's
//! `json.dumps`, as transformers calls it) and `strftime_now` (the time through C's
//! `strftime`).

use minijinja::value::{Kwargs, Value};
use minijinja::{Error, ErrorKind};

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, each keyword taken.
pub(super) fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
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
pub(super) fn strftime_now(format: String) -> Result<String, Error> {
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
    use std::collections::BTreeMap;

    use super::super::ChatTemplate;
    use super::*;

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
