//! Checkpoint tags: how they are named and which are safe to join onto a directory.

use crate::CheckpointError;

/// DeepSpeed's default tag for a save after `global_step` optimizer steps.
pub fn default_tag(global_step: u64) -> String {
    format!("global_step{global_step}")
}

/// Accepts a tag only if it is one plain path component: 1-200 bytes of ASCII letters,
/// digits, `.`, `_` and `-`, not `.` or `..`, and not ending in `.partial` (the suffix of
/// checkpoints being written). Anything else could escape the directory or mean different
/// things on different filesystems.
pub fn validate_tag(tag: &str) -> Result<&str, CheckpointError> {
    let reason = if tag.is_empty() {
        Some("it is empty")
    } else if tag.len() > 200 {
        Some("it is longer than 200 bytes")
    } else if tag == "." || tag == ".." {
        Some("it names a directory, not a checkpoint")
    } else if !tag.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        Some("only ASCII letters, digits, '.', '_' and '-' are allowed")
    } else if tag.ends_with(".partial") || tag.ends_with(".deleting") || tag == "latest" {
        Some("`latest` and names ending in `.partial` or `.deleting` are reserved")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(CheckpointError::InvalidTag { tag: tag.to_string(), reason }),
        None => Ok(tag),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_that_could_escape_or_confuse_are_rejected() {
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            "a\\b",
            "/abs",
            "x\0y",
            "tag with space",
            "ü",
            "latest",
            "s.partial",
            "s.deleting",
        ] {
            assert!(validate_tag(bad).is_err(), "{bad:?}");
        }
        assert!(validate_tag(&"a".repeat(201)).is_err());
        for good in ["global_step10", "best-v1.2", "latest_manual", "..hidden"] {
            assert_eq!(validate_tag(good).ok(), Some(good));
        }
    }
}
