//! Crash-consistent file writes: write aside, flush to disk, rename over, flush the
//! directory. After a crash at any point the destination holds either its previous
//! content (or nothing) or the whole new content, never a mix; a leftover temporary
//! file (`.NAME.PID.N.tmp` beside it) is the only trace.

use std::fs::{self, File};
use std::io::{BufWriter, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::PersistError;
use super::format::WriteSink;

/// Distinguishes the temporary files of one process.
static NEXT_TEMP: AtomicU64 = AtomicU64::new(0);

/// Bytes buffered between the encoder and the file.
const BUFFER: usize = 1 << 20;

/// A fresh temporary path beside `path`, and the directory they share.
fn temp_beside(path: &Path) -> Result<(PathBuf, PathBuf), PersistError> {
    let name = path.file_name().ok_or(PersistError::Io {
        kind: std::io::ErrorKind::InvalidInput,
        os_error: None,
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let n = NEXT_TEMP.fetch_add(1, Ordering::Relaxed);
    let mut temp = std::ffi::OsString::from(".");
    temp.push(name);
    temp.push(format!(".{}.{n}.tmp", std::process::id()));
    Ok((dir.join(temp), dir))
}

/// Creates the file at `path` with what `write` puts into the sink, crash-consistently
/// (see the module docs). On error the temporary file is removed and `path` is as it
/// was (unless only the final directory flush failed: then the new file is in place
/// but may not survive a crash). O(bytes written).
///
/// # Errors
/// What `write` returns, and [`PersistError::Io`].
pub(crate) fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut WriteSink<BufWriter<File>>) -> Result<(), PersistError>,
) -> Result<(), PersistError> {
    let (temp, dir) = temp_beside(path)?;
    let file = File::options().write(true).create_new(true).open(&temp)?;
    let written = (|| {
        let mut sink = WriteSink(BufWriter::with_capacity(BUFFER, file));
        write(&mut sink)?;
        sink.0.flush()?;
        // Synced and closed before the rename: no handle outlives the temporary name.
        {
            let file = sink.0.into_inner().map_err(|e| e.into_error())?;
            file.sync_all()?;
        }
        fs::rename(&temp, path)?;
        Ok(())
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&temp);
        return Err(e);
    }
    sync_dir(&dir)
}

/// Flushes a directory's entries (the rename) to disk. Where directories cannot be
/// opened as files (Windows), the rename's own durability is all there is.
fn sync_dir(dir: &Path) -> Result<(), PersistError> {
    if cfg!(unix) {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persist::format::Sink;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvpage-file-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    #[cfg_attr(miri, ignore = "file system: Miri's isolation forbids it")]
    fn writes_the_whole_content_and_leaves_no_temporary() {
        let dir = scratch("ok");
        let path = dir.join("seq.kv");
        fs::write(&path, b"old").unwrap();
        write_atomically(&path, |s| s.put(b"new content")).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new content");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "file system: Miri's isolation forbids it")]
    fn a_failed_write_keeps_the_old_file_and_removes_the_temporary() {
        let dir = scratch("fail");
        let path = dir.join("seq.kv");
        fs::write(&path, b"old").unwrap();
        let e = write_atomically(&path, |s| {
            s.put(b"half")?;
            Err(PersistError::ModelMismatch)
        });
        assert_eq!(e, Err(PersistError::ModelMismatch));
        assert_eq!(fs::read(&path).unwrap(), b"old");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
        let missing = dir.join("no-such-dir").join("seq.kv");
        assert!(matches!(
            write_atomically(&missing, |s| s.put(b"x")),
            Err(PersistError::Io { .. })
        ));
        fs::remove_dir_all(&dir).unwrap();
    }
}
