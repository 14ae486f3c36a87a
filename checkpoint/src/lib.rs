//! Sharded checkpoints for zerotrain.
//!
//! A checkpoint lives in `<dir>/<tag>/`; the tag names one save. This crate starts with the
//! rules every reader and writer shares: how tags are named and which are safe to join onto
//! a directory. Writing, loading and resharding build on them.
//!
//! ```
//! use zerotrain_checkpoint::{default_tag, validate_tag};
//! assert_eq!(default_tag(120), "global_step120");
//! assert!(validate_tag("../elsewhere").is_err());
//! ```
#![deny(missing_docs)]

/// Errors from checkpoint naming, writing and loading.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A tag that is empty, too long, or could escape the checkpoint directory.
    #[error("invalid checkpoint tag {tag:?}: {reason}")]
    InvalidTag {
        /// The tag as given.
        tag: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// DeepSpeed's default tag for a save after `global_step` optimizer steps.
pub fn default_tag(global_step: u64) -> String {
    format!("global_step{global_step}")
}

/// Accepts a tag only if it is one plain path component: 1-255 bytes of ASCII letters,
/// digits, `.`, `_` and `-`, not `.` or `..`. Anything else could escape the directory or
/// mean different things on different filesystems.
pub fn validate_tag(tag: &str) -> Result<&str, CheckpointError> {
    let reason = if tag.is_empty() {
        Some("it is empty")
    } else if tag.len() > 255 {
        Some("it is longer than 255 bytes")
    } else if tag == "." || tag == ".." {
        Some("it names a directory, not a checkpoint")
    } else if !tag.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        Some("only ASCII letters, digits, '.', '_' and '-' are allowed")
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
        for bad in ["", ".", "..", "../x", "a/b", "a\\b", "/abs", "x\0y", "tag with space", "ü"] {
            assert!(validate_tag(bad).is_err(), "{bad:?}");
        }
        assert!(validate_tag(&"a".repeat(256)).is_err());
        for good in ["global_step10", "best-v1.2", "latest_manual", "..hidden"] {
            assert_eq!(validate_tag(good), Ok(good));
        }
    }
}
