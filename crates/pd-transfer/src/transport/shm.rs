//! Shared KV memory for same-host transfers: the prefill worker keeps its KV blocks in a file under
//! `/dev/shm` ([`SharedRegion`]); a decode worker on the same host maps it read-only
//! ([`SharedView`]) and copies each block the sender names straight out of it.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use crate::sys::{map_created, map_read_only, Mmap, MmapMut};

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

    /// A new region at `path` (which must not exist).
    pub fn create_at(path: &Path, bytes: usize) -> io::Result<SharedRegion> {
        let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
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
    /// Opens the shared KV file at `path`. Only files named like the ones [`SharedRegion::create`]
    /// makes are opened, and only if they hold a whole number of blocks.
    pub fn open(path: &Path, block_bytes: usize) -> io::Result<SharedView> {
        let name_ok = path.parent() == Some(Path::new(SHM_DIR))
            && path.file_name().is_some_and(|n| n.to_string_lossy().starts_with(SHM_PREFIX));
        if !name_ok {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a pdserve shared KV file ({SHM_DIR}/{SHM_PREFIX}*)", path.display()),
            ));
        }
        let file = File::open(path)?;
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
        drop(r);
        assert!(!path.exists(), "the file goes with the region");
    }
}
