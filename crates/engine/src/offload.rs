//! The KV offload tier's memory: host memory beyond the pool, then a file under a size cap. The KV
//! cache decides what goes where (`pdserve_kvcache`'s tier); this performs its copies, in order, before
//! each step, through the backend's block interface (`read_block`, `write_block`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use pdserve_kvcache::{TierConfig, TierCopy, TierSlot};
use pdserve_model::{Backend, ModelError};

/// How big the offload tier is (`--kv-offloading-size`, `--kv-offload-disk-gib`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OffloadConfig {
    /// Host memory for evicted blocks, in bytes (rounded down to whole blocks).
    pub host_bytes: usize,
    /// Disk for evicted blocks, in bytes; their file is made in `disk_dir` (the system's temporary
    /// folder when `None`) and its name removed at once: the open file lives as long as the process,
    /// and nothing is left behind however it ends.
    pub disk_bytes: usize,
    pub disk_dir: Option<PathBuf>,
}

impl OffloadConfig {
    /// Whether there is a tier at all.
    pub fn is_on(&self) -> bool {
        self.host_bytes + self.disk_bytes > 0
    }
}

/// The tier's bytes: `host_blocks` blocks in memory, `disk_blocks` in a file.
#[derive(Debug)]
pub(crate) struct OffloadStore {
    block_bytes: usize,
    host: Vec<u8>,
    host_blocks: u32,
    disk: Option<File>,
    /// One block, for moves to and from the file.
    scratch: Vec<u8>,
}

impl OffloadStore {
    /// The store for `config` with blocks of `block_bytes`, and the KV cache's tier of the same size.
    pub(crate) fn new(
        config: &OffloadConfig,
        block_bytes: usize,
    ) -> std::io::Result<(OffloadStore, TierConfig)> {
        let bb = block_bytes.max(1);
        // (At most 2^30 blocks each: their sum stays a u32.)
        let blocks = |bytes: usize| u32::try_from(bytes / bb).unwrap_or(u32::MAX).min(1 << 30);
        let (host_blocks, disk_blocks) = (blocks(config.host_bytes), blocks(config.disk_bytes));
        let disk = if disk_blocks > 0 {
            let dir = config.disk_dir.clone().unwrap_or_else(std::env::temp_dir);
            let nonce = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let path = dir.join(format!("pdserve-kv-offload-{}-{nonce:08x}.bin", std::process::id()));
            let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
            std::fs::remove_file(&path)?;
            // Sparse: the disk holds only what was written.
            file.set_len(u64::from(disk_blocks) * bb as u64)?;
            Some(file)
        } else {
            None
        };
        let store = OffloadStore {
            block_bytes,
            // Zeroed pages are mapped on first touch: memory is taken only as blocks arrive.
            host: vec![0; host_blocks as usize * block_bytes],
            host_blocks,
            disk,
            scratch: vec![0; block_bytes],
        };
        Ok((store, TierConfig { host_blocks, disk_blocks }))
    }

    fn host(&mut self, s: TierSlot) -> &mut [u8] {
        let bb = self.block_bytes;
        &mut self.host[s.0 as usize * bb..][..bb]
    }

    fn disk_at(&self, s: TierSlot) -> u64 {
        u64::from(s.0 - self.host_blocks) * self.block_bytes as u64
    }

    fn io(e: std::io::Error) -> ModelError {
        ModelError::InvalidInput { problem: format!("the KV offload file: {e}") }
    }

    fn file(&self) -> Result<&File, ModelError> {
        self.disk.as_ref().ok_or_else(|| Self::io(std::io::ErrorKind::NotFound.into()))
    }

    /// Writes `scratch` to slot `s`, a disk slot.
    fn store_scratch(&mut self, s: TierSlot) -> Result<(), ModelError> {
        self.file()?.write_all_at(&self.scratch, self.disk_at(s)).map_err(Self::io)
    }

    /// Performs the KV cache's tier copies, in order. An error leaves them partly done: the step that
    /// needed them must not run.
    pub(crate) fn apply(&mut self, backend: &mut dyn Backend, copies: &[TierCopy]) -> Result<(), ModelError> {
        for c in copies {
            match *c {
                TierCopy::Out { block, slot } if slot.0 < self.host_blocks => {
                    backend.read_block(block, self.host(slot))?;
                }
                TierCopy::Out { block, slot } => {
                    let mut scratch = std::mem::take(&mut self.scratch);
                    let r = backend.read_block(block, &mut scratch);
                    self.scratch = scratch;
                    r?;
                    self.store_scratch(slot)?;
                }
                TierCopy::Down { from, to } => {
                    let bb = self.block_bytes;
                    let (host, scratch) = (&self.host, &mut self.scratch);
                    scratch.copy_from_slice(&host[from.0 as usize * bb..][..bb]);
                    self.store_scratch(to)?;
                }
                TierCopy::In { slot, block } if slot.0 < self.host_blocks => {
                    let bb = self.block_bytes;
                    backend.write_block(block, &self.host[slot.0 as usize * bb..][..bb])?;
                }
                TierCopy::In { slot, block } => {
                    let at = self.disk_at(slot);
                    let mut scratch = std::mem::take(&mut self.scratch);
                    let r = self.file().and_then(|f| f.read_exact_at(&mut scratch, at).map_err(Self::io));
                    self.scratch = scratch;
                    r?;
                    backend.write_block(block, &self.scratch)?;
                }
            }
        }
        Ok(())
    }
}
