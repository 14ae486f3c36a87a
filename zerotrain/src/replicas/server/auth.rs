//! Who may talk to a parameter server: a shared secret (`local_sgd.auth_token_file`, or the
//! `ZEROTRAIN_SERVER_TOKEN` environment variable, which wins) that every call carries as
//! `authorization: Bearer <token>` and the server checks before reading anything of the
//! call. A server without a token answers anyone who reaches its port, and says so.

use std::path::Path;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

use crate::{Error, Result};

/// The environment variable that holds the token (over the config's file).
pub const TOKEN_VARIABLE: &str = "ZEROTRAIN_SERVER_TOKEN";

/// A shared secret (never printed).
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// A token of visible ASCII (it travels in a header), at least 16 characters.
    pub fn new(secret: &str, from: &str) -> Result<Self> {
        let secret = secret.trim();
        if secret.len() < 16 || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::Usage(format!(
                "{from}: a server token is at least 16 visible ASCII characters (no spaces); e.g. `openssl rand \
                 -hex 32`"
            )));
        }
        Ok(Self(secret.to_owned()))
    }

    /// The token of `file` (`local_sgd.auth_token_file`), or of [`TOKEN_VARIABLE`] when it
    /// is set; `None` without either.
    pub fn load(file: Option<&Path>) -> Result<Option<Self>> {
        if let Some(secret) = std::env::var_os(TOKEN_VARIABLE).filter(|v| !v.is_empty()) {
            let secret = secret.into_string().map_err(|_| Error::Usage(format!("{TOKEN_VARIABLE}: not UTF-8")))?;
            return Self::new(&secret, TOKEN_VARIABLE).map(Some);
        }
        let Some(file) = file else { return Ok(None) };
        let secret = read_small_text(file)?;
        if let Some(mode) = readable_by_others(file) {
            eprintln!(
                "zerotrain: warning: local_sgd.auth_token_file {} can be read by other users (mode {mode:o}): \
                 chmod 600 it",
                file.display()
            );
        }
        Self::new(&secret, &format!("local_sgd.auth_token_file {}", file.display())).map(Some)
    }

    fn header(&self) -> String {
        format!("Bearer {}", self.0)
    }
}

/// The worker's side: every call carries the token, if there is one.
#[derive(Clone)]
pub struct Attach(Option<MetadataValue<Ascii>>);

impl Attach {
    /// Attaches `token` to every call (nothing without one).
    pub fn new(token: Option<&Token>) -> Self {
        Self(token.and_then(|t| MetadataValue::try_from(t.header()).ok()))
    }
}

impl Interceptor for Attach {
    fn call(&mut self, mut request: Request<()>) -> std::result::Result<Request<()>, Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// The server's side: with a token, a call without it, or with another, is refused before
/// anything of it is read.
#[derive(Clone)]
pub struct Check(Option<String>);

impl Check {
    /// Refuses calls without `token` (none: takes every call).
    pub fn new(token: Option<&Token>) -> Self {
        Self(token.map(Token::header))
    }
}

impl Interceptor for Check {
    fn call(&mut self, request: Request<()>) -> std::result::Result<Request<()>, Status> {
        let Some(want) = &self.0 else { return Ok(request) };
        match request.metadata().get("authorization").map(|v| v.as_bytes()) {
            None => Err(Status::unauthenticated(format!(
                "no token: this server needs one (local_sgd.auth_token_file or {TOKEN_VARIABLE})"
            ))),
            Some(got) if !same(got, want.as_bytes()) => {
                Err(Status::unauthenticated("a wrong token (local_sgd.auth_token_file or ZEROTRAIN_SERVER_TOKEN)"))
            }
            Some(_) => Ok(request),
        }
    }
}

/// Whether `a` equals `b`, in time that depends on their lengths only (`subtle`'s
/// constant-time comparison, which the optimiser cannot turn into an early exit).
fn same(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    bool::from(a.ct_eq(b))
}

/// The file's permission bits where others than its owner may read it.
fn readable_by_others(file: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(file).ok()?.permissions().mode() & 0o777;
    (mode & 0o044 != 0).then_some(mode)
}

/// The text of a small file a config names (a token, a PEM certificate or key): a regular
/// file of at most 1 MiB, refused by name otherwise (a FIFO would block the open, a device
/// would be read without end).
pub(super) fn read_small_text(file: &Path) -> Result<String> {
    let io = |cause| Error::Io { path: file.to_path_buf(), cause };
    let bytes = zerotrain_checkpoint::read_bounded(file, 1 << 20).map_err(io)?;
    String::from_utf8(bytes).map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn tokens_are_long_visible_ascii_and_compared_whole() {
        assert!(super::Token::new("short", "t").is_err());
        assert!(super::Token::new("sixteen chars but spaces", "t").is_err());
        let t = super::Token::new("  0123456789abcdef0123\n", "t").unwrap();
        assert_eq!(format!("{t:?}"), "Token(..)");
        assert!(super::same(b"Bearer abc", b"Bearer abc"));
        assert!(!super::same(b"Bearer abd", b"Bearer abc") && !super::same(b"Bearer ab", b"Bearer abc"));
    }

    /// A token file others may read is told apart (the load warns of it); one only its
    /// owner reads is not.
    #[test]
    fn a_token_file_others_can_read_is_noticed() {
        use std::os::unix::fs::PermissionsExt;
        let file = std::env::temp_dir().join(format!("zerotrain-token-{}", std::process::id()));
        std::fs::write(&file, "0123456789abcdef0123").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(super::readable_by_others(&file), Some(0o644));
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(super::readable_by_others(&file), None);
        assert!(super::Token::load(Some(&file)).unwrap().is_some());
        std::fs::remove_file(&file).unwrap();
    }
}
