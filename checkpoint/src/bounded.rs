//! Reading a small file whose path someone else chose (a manifest, `latest`, a model's
//! `config.json`, a tokenizer): only a regular file, and no more than a limit.
//!
//! # Note: why not `fs::read`
//! `fs::read` believes the size the file reports and reads to its end: a symlink to
//! `/dev/zero` reports 0 bytes and grows the buffer until the machine runs out of memory,
//! and opening a FIFO blocks until a writer comes, which may be never. So the file is
//! opened without blocking (`O_NONBLOCK`, which a FIFO's open honours and a regular file
//! ignores), refused unless it is a regular file, and read through a cap one byte past the
//! limit, which catches a file that grew after it was measured.

use std::fs::File;
use std::io::{Error, ErrorKind, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// The largest text file (a config, a tokenizer, an index) read whole: 1 GiB, beyond any
/// real `tokenizer.json` (a few tens of MiB) or config.
pub const MAX_TEXT_FILE_BYTES: u64 = 1 << 30;

/// Linux's `O_NONBLOCK`.
const O_NONBLOCK: i32 = 0o4000;

/// The bytes of `path`, a regular file of at most `limit` bytes; an error of kind
/// `InvalidData` naming what it is otherwise (a FIFO, a device, a folder), of kind
/// `FileTooLarge` where it is larger.
/// `NotFound` where there is no such file, as `fs::read` says it.
pub fn read_bounded(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let file = open_regular(path)?;
    // A file that says it is larger is refused unread (a sparse 2 GiB file would be read to
    // the limit first); one that grows past the limit while it is read, at the limit.
    let size = file.metadata()?.len();
    if size > limit {
        return Err(Error::new(ErrorKind::FileTooLarge, format!("{size} bytes, larger than {limit}: refused")));
    }
    let mut bytes = Vec::new();
    let read = Read::take(&file, limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if read as u64 > limit {
        return Err(Error::new(ErrorKind::FileTooLarge, format!("larger than {limit} bytes: refused")));
    }
    drop::<File>(file);
    Ok(bytes)
}

/// `path` opened for reading if it is a regular file: a FIFO, a device, a folder or a
/// socket is refused at once (an error of kind `InvalidData` saying which) instead of
/// blocking in the open or being read for ever (`/dev/zero`). For inputs read in pieces or
/// mapped (a corpus, a token file, a checkpoint's tensors) as [`read_bounded`] is for whole
/// ones.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let file = std::fs::OpenOptions::new().read(true).custom_flags(O_NONBLOCK).open(path)?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else if kind.is_dir() {
            "a folder"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "not a file"
        };
        return Err(Error::new(ErrorKind::InvalidData, format!("{what}, not a regular file: refused")));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device behind a symlink, a FIFO (its open would block without a writer), a folder
    /// and a file past the limit are refused at once; a small file reads whole.
    #[test]
    fn only_regular_files_within_the_limit_are_read() {
        let dir = std::env::temp_dir().join(format!("zerotrain-bounded-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let zero = dir.join("config.json");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let err = read_bounded(&zero, 1 << 20).unwrap_err();
        assert_eq!(
            (err.kind(), err.to_string().as_str()),
            (ErrorKind::InvalidData, "a device, not a regular file: refused")
        );
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        let err = read_bounded(&fifo, 1 << 20).unwrap_err();
        assert!(err.to_string().starts_with("a FIFO, not a regular file"), "{err}");
        assert!(read_bounded(&dir, 10).unwrap_err().to_string().starts_with("a folder"));
        let big = dir.join("big");
        std::fs::write(&big, [7u8; 11]).unwrap();
        assert_eq!(read_bounded(&big, 10).unwrap_err().to_string(), "11 bytes, larger than 10: refused");
        // A sparse file of 2 GiB is refused by its size, unread (it was read to the limit).
        let sparse = dir.join("sparse");
        std::fs::File::create(&sparse).unwrap().set_len(2 << 30).unwrap();
        let err = read_bounded(&sparse, 1 << 30).unwrap_err().to_string();
        assert_eq!(err, "2147483648 bytes, larger than 1073741824: refused");
        // Opened for reading in pieces: the same refusals, at once.
        assert!(open_regular(&fifo).unwrap_err().to_string().starts_with("a FIFO"));
        assert!(open_regular(&zero).unwrap_err().to_string().starts_with("a device"));
        assert!(open_regular(&big).is_ok());
        assert_eq!(read_bounded(&big, 11).unwrap(), [7u8; 11]);
        assert_eq!(read_bounded(&dir.join("none"), 10).unwrap_err().kind(), ErrorKind::NotFound);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
