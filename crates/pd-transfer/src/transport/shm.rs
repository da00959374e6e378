//! Shared KV memory for same-host transfers: the prefill worker keeps its KV blocks in a file under
//! `/dev/shm` ([`SharedRegion`]); a decode worker on the same host maps it read-only
//! ([`SharedView`]) and copies each block the sender names straight out of it.

use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::sys::{
    allocate, effective_uid, lock_shared, map_created, map_read_only, unlocked, Mmap, MmapMut, O_NOFOLLOW,
};

/// Where shared KV files live, and how their names start; a view opens nothing else.
pub const SHM_DIR: &str = "/dev/shm";
pub const SHM_PREFIX: &str = "pdserve-kv-";

/// The scope of processes given none: every such stack of one user on one host.
pub const LOCAL_SCOPE: &str = "local";

/// Whether `scope` may name a stack's shared KV files (`/dev/shm/pdserve-kv-{scope}-...`): 1 to 32
/// lowercase letters and digits. A region is made in its stack's scope and a view opens only files
/// of its own, so one stack never maps another's KV; each stack on a host needs its own (`cargo xtask
/// serve` draws a random one per stack). Chosen apart from the cluster secret: file names in
/// `/dev/shm` are visible to every local user, so nothing derived from the secret may appear there.
pub fn valid_scope(scope: &str) -> bool {
    (1..=32).contains(&scope.len()) && scope.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what)
}

/// A writable shared region of `bytes` bytes (zeroed) in a new file under `/dev/shm`, removed when
/// the region is dropped. It is page-aligned.
#[derive(Debug)]
pub struct SharedRegion {
    map: MmapMut,
    path: PathBuf,
    /// The file, open for as long as the region lives, holding the shared lock that tells a
    /// sweeping creator this region's owner is alive.
    _owner: std::fs::File,
}

impl SharedRegion {
    /// A new region in `scope` with a name of its own (`/dev/shm/pdserve-kv-{scope}-{pid}-{n}`).
    pub fn create(scope: &str, bytes: usize) -> io::Result<SharedRegion> {
        if !valid_scope(scope) {
            return Err(invalid(format!("{scope:?} is not a shared KV scope (1-32 of a-z, 0-9)")));
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = PathBuf::from(format!("{SHM_DIR}/{SHM_PREFIX}{scope}-{}-{nanos}", std::process::id()));
        remove_orphans(Path::new(SHM_DIR), ORPHAN_AGE);
        SharedRegion::create_at(&path, bytes)
    }

    /// A new region at `path` (which must not exist), readable by this user only. Every page of it
    /// exists from the start: a receiver maps the whole region at its first pull, and mapping a page
    /// the file does not hold yet makes the kernel allocate and clear it then (the first 2,048-token
    /// pull from a fresh prefill worker took 214 ms; 28 ms now, the mapping alone). A `/dev/shm` too
    /// small for the region is an error here (and the file is removed), not a crash later.
    pub fn create_at(path: &Path, bytes: usize) -> io::Result<SharedRegion> {
        let file =
            std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)?;
        let made = lock_shared(&file)
            .and_then(|()| file.set_len(bytes as u64))
            .and_then(|()| allocate(&file, bytes as u64))
            .and_then(|()| {
                let mut map = map_created(&file)?;
                for at in (0..map.len()).step_by(4096) {
                    // Each page mapped here too. The value is opaque to the compiler, so the store stays.
                    map[at] = std::hint::black_box(0);
                }
                Ok(map)
            });
        match made {
            Ok(map) => Ok(SharedRegion { map, path: path.to_path_buf(), _owner: file }),
            Err(e) => {
                let _ = std::fs::remove_file(path);
                Err(e)
            }
        }
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

/// Regions younger than this are never taken for orphans: between creating its file and locking it,
/// a new region's owner holds no lock yet.
const ORPHAN_AGE: std::time::Duration = std::time::Duration::from_secs(10);

/// Removes the region files in `dir` whose owner is gone: this user's `pdserve-kv-*` files, older
/// than `age`, on which no process holds a lock. A worker removes its own region when it stops, but
/// a killed one (SIGKILL, a crash) runs no destructor, and each file it leaves holds a whole KV pool
/// of memory until someone removes it. The lock, not the process id in the name, tells who is
/// alive: workers in containers that share `/dev/shm` need not share a process-id namespace. A
/// receiver's view of a removed file stays readable until it lets it go.
pub fn remove_orphans(dir: &Path, age: std::time::Duration) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        if !e.file_name().to_string_lossy().starts_with(SHM_PREFIX) {
            continue;
        }
        let path = e.path();
        let Ok(file) = std::fs::OpenOptions::new().read(true).custom_flags(O_NOFOLLOW).open(&path) else {
            continue;
        };
        let old = file.metadata().is_ok_and(|m| {
            m.file_type().is_file()
                && m.uid() == effective_uid()
                && m.modified().ok().and_then(|t| t.elapsed().ok()).is_some_and(|a| a >= age)
        });
        if old && unlocked(&file) && std::fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Another process's shared region, mapped read-only and cut into blocks of `block_bytes`.
#[derive(Debug)]
pub struct SharedView {
    map: Mmap,
    block_bytes: usize,
}

impl SharedView {
    /// Opens the shared KV file at `path`. Only files like the ones [`SharedRegion::create`] makes in
    /// `scope` are opened: named `/dev/shm/pdserve-kv-{scope}-*`, a regular file and not a link to
    /// one elsewhere, owned by this process's user and readable by nobody else, holding a whole
    /// number of blocks. Whatever names a path, nothing else on the host is read.
    pub fn open(path: &Path, scope: &str, block_bytes: usize) -> io::Result<SharedView> {
        let prefix = format!("{SHM_PREFIX}{scope}-");
        let name_ok = valid_scope(scope)
            && path.parent() == Some(Path::new(SHM_DIR))
            && path.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&prefix));
        if !name_ok {
            let want = format!("{SHM_DIR}/{prefix}*");
            return Err(invalid(format!(
                "{} is not a shared KV file of this stack ({want})",
                path.display()
            )));
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
        let mut r = SharedRegion::create(LOCAL_SCOPE, 4 * 64).unwrap();
        r.bytes_mut()[64..128].fill(7);
        let v = SharedView::open(r.path(), LOCAL_SCOPE, 64).unwrap();
        assert_eq!(v.block(1).unwrap(), &[7u8; 64][..]);
        assert!(v.block(4).is_none());
        assert!(SharedView::open(r.path(), LOCAL_SCOPE, 48).is_err(), "not whole blocks");
        assert!(SharedView::open(Path::new("/etc/passwd"), LOCAL_SCOPE, 1).is_err());
        let path = r.path().to_path_buf();
        // A file with the right name that the region did not make: a link to another file, a file
        // others may read, a file of another user.
        let pid = std::process::id();
        let link = PathBuf::from(format!("{SHM_DIR}/{SHM_PREFIX}{LOCAL_SCOPE}-link-{pid}"));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(SharedView::open(&link, LOCAL_SCOPE, 64).is_err(), "a symbolic link is not followed");
        std::fs::remove_file(&link).unwrap();
        let open = PathBuf::from(format!("{SHM_DIR}/{SHM_PREFIX}{LOCAL_SCOPE}-open-{pid}"));
        std::fs::write(&open, [0u8; 64]).unwrap();
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        assert!(SharedView::open(&open, LOCAL_SCOPE, 64).is_err(), "readable by others: not a region's file");
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        assert!(SharedView::open(&open, LOCAL_SCOPE, 64).is_ok());
        if effective_uid() == 0 {
            std::os::unix::fs::chown(&open, Some(65534), None).unwrap();
            assert!(SharedView::open(&open, LOCAL_SCOPE, 64).is_err(), "another user's file");
        }
        std::fs::remove_file(&open).unwrap();
        drop(r);
        assert!(!path.exists(), "the file goes with the region");
    }

    #[test]
    fn regions_whose_owner_is_gone_are_removed_and_live_ones_kept() {
        let dir = std::env::temp_dir().join(format!("pdserve-orphans-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let live = SharedRegion::create_at(&dir.join(format!("{SHM_PREFIX}t-1-1")), 4096).unwrap();
        // A killed worker's file: the same name, nobody holding it.
        let orphan = dir.join(format!("{SHM_PREFIX}t-2-2"));
        std::fs::write(&orphan, [0u8; 64]).unwrap();
        let unrelated = dir.join("not-a-region");
        std::fs::write(&unrelated, [0u8; 64]).unwrap();
        assert_eq!(remove_orphans(&dir, ORPHAN_AGE), 0, "a file younger than the age is never taken");
        assert_eq!(remove_orphans(&dir, std::time::Duration::ZERO), 1);
        assert!(!orphan.exists(), "the orphan is removed");
        assert!(live.path().exists() && unrelated.exists(), "a live region and other files stay");
        assert_eq!(live.bytes().len(), 4096);
        drop(live);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_view_opens_only_its_own_stacks_files() {
        let (ours, theirs) = ("stacka", "stackb");
        let r = SharedRegion::create(theirs, 64).unwrap();
        assert!(r.path().to_string_lossy().contains(theirs));
        assert!(SharedView::open(r.path(), theirs, 64).is_ok());
        let e = SharedView::open(r.path(), ours, 64).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        assert!(SharedView::open(r.path(), LOCAL_SCOPE, 64).is_err());
        assert!(SharedRegion::create("../etc", 64).is_err(), "a scope is a name, not a path");
        assert!(!valid_scope("") && !valid_scope("Stack") && valid_scope("0a1b"));
    }
}
