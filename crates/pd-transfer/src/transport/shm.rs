//! Shared KV memory for same-host transfers: the prefill worker keeps its KV blocks in a file under
//! `/dev/shm` ([`SharedRegion`]); a decode worker on the same host maps it read-only
//! ([`SharedView`]) and copies each block the sender names straight out of it.

use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::sys::{effective_uid, map_created, map_read_only, Mmap, MmapMut, O_NOFOLLOW};

/// Where shared KV files live, and how their names start; a view opens nothing else.
pub const SHM_DIR: &str = "/dev/shm";
pub const SHM_PREFIX: &str = "pdserve-kv-";

/// A writable shared region of `bytes` bytes (zeroed) in a new file under `/dev/shm`, removed when
/// the region is dropped. It is page-aligned.
#[derive(Debug)]
pub struct SharedRegion {
    map: MmapMut,
    path: PathBuf,
}

impl SharedRegion {
    /// A new region with a name of its own (`/dev/shm/pdserve-kv-{pid}-{n}`).
    pub fn create(bytes: usize) -> io::Result<SharedRegion> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = PathBuf::from(format!("{SHM_DIR}/{SHM_PREFIX}{}-{nanos}", std::process::id()));
        SharedRegion::create_at(&path, bytes)
    }

    /// A new region at `path` (which must not exist), readable by this user only.
    pub fn create_at(path: &Path, bytes: usize) -> io::Result<SharedRegion> {
        let file =
            std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)?;
        file.set_len(bytes as u64)?;
        let map = map_created(&file)?;
        Ok(SharedRegion { map, path: path.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Another process's shared region, mapped read-only and cut into blocks of `block_bytes`.
#[derive(Debug)]
pub struct SharedView {
    map: Mmap,
    block_bytes: usize,
}

impl SharedView {
    /// Opens the shared KV file at `path`. Only files like the ones [`SharedRegion::create`] makes are
    /// opened: named `/dev/shm/pdserve-kv-*`, a regular file and not a link to one elsewhere, owned by
    /// this process's user and readable by nobody else, holding a whole number of blocks. Whatever
    /// names a path, nothing else on the host is read.
    pub fn open(path: &Path, block_bytes: usize) -> io::Result<SharedView> {
        let name_ok = path.parent() == Some(Path::new(SHM_DIR))
            && path.file_name().is_some_and(|n| n.to_string_lossy().starts_with(SHM_PREFIX));
        if !name_ok {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a pdserve shared KV file ({SHM_DIR}/{SHM_PREFIX}*)", path.display()),
            ));
        }
        let file = std::fs::OpenOptions::new().read(true).custom_flags(O_NOFOLLOW).open(path)?;
        let meta = file.metadata()?;
        if !meta.file_type().is_file() || meta.uid() != effective_uid() || meta.mode() & 0o077 != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} is not a shared KV file of this user (regular, mode 0600)", path.display()),
            ));
        }
        let map = map_read_only(&file)?;
        if block_bytes == 0 || map.len() % block_bytes != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is not a whole number of {block_bytes}-byte KV blocks", path.display()),
            ));
        }
        Ok(SharedView { map, block_bytes })
    }

    /// Block `slot`'s bytes, or `None` past the end.
    pub fn block(&self, slot: u32) -> Option<&[u8]> {
        let at = slot as usize * self.block_bytes;
        self.map.get(at..at + self.block_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_reads_what_the_region_holds_and_nothing_else_opens() {
        let mut r = SharedRegion::create(4 * 64).unwrap();
        r.bytes_mut()[64..128].fill(7);
        let v = SharedView::open(r.path(), 64).unwrap();
        assert_eq!(v.block(1).unwrap(), &[7u8; 64][..]);
        assert!(v.block(4).is_none());
        assert!(SharedView::open(r.path(), 48).is_err(), "not whole blocks");
        assert!(SharedView::open(Path::new("/etc/passwd"), 1).is_err());
        let path = r.path().to_path_buf();
        // A file with the right name that the region did not make: a link to another file, a file
        // others may read, a file of another user.
        let pid = std::process::id();
        let link = PathBuf::from(format!("{SHM_DIR}/{SHM_PREFIX}link-{pid}"));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(SharedView::open(&link, 64).is_err(), "a symbolic link is not followed");
        std::fs::remove_file(&link).unwrap();
        let open = PathBuf::from(format!("{SHM_DIR}/{SHM_PREFIX}open-{pid}"));
        std::fs::write(&open, [0u8; 64]).unwrap();
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        assert!(SharedView::open(&open, 64).is_err(), "readable by others: not a region's file");
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        assert!(SharedView::open(&open, 64).is_ok());
        if effective_uid() == 0 {
            std::os::unix::fs::chown(&open, Some(65534), None).unwrap();
            assert!(SharedView::open(&open, 64).is_err(), "another user's file");
        }
        std::fs::remove_file(&open).unwrap();
        drop(r);
        assert!(!path.exists(), "the file goes with the region");
    }
}
