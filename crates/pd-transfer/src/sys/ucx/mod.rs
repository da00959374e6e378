//! UCX's UCP API (libucp, Debian's `libucx-dev`; the library NIXL drives), as much as one-sided reads
//! of registered memory need, behind two safe owners:
//!
//! - [`Exporter`]: a sending side's memory, registered for remote reads, with the blob a reader needs
//!   (this worker's address, the packed remote key, the base address and length); it progresses its
//!   worker on a thread of its own, so reads are served whatever the caller's thread is doing (over
//!   UCX's TCP transport, reads are served by the target's CPU).
//! - [`Importer`]: a reading side's worker, endpoints to exporters (from their blobs), and `get`s into
//!   buffers of its own, progressed by the caller.
//!
//! `ffi.rs` mirrors UCX 1.13's `ucp.h`/`ucp_def.h` (sizes checked at compile time); only the fields
//! their `field_mask` bits name are read by the library.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

mod ffi;
use ffi::*;

/// A UCP context and one worker on it, single-threaded; destroyed in order when dropped.
struct Node {
    context: Handle,
    worker: Handle,
}

impl Node {
    fn new(wakeup: bool, thread_mode: c_int) -> Result<Node, UcxError> {
        let mut config: Handle = std::ptr::null_mut();
        // SAFETY: null prefix and file read UCX's defaults and UCX_* environment variables.
        check("ucp_config_read", unsafe {
            ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config)
        })?;
        let params = UcpParams {
            field_mask: UCP_PARAM_FIELD_FEATURES,
            features: UCP_FEATURE_RMA | if wakeup { UCP_FEATURE_WAKEUP } else { 0 },
            request_size: 0,
            request_init: std::ptr::null(),
            request_cleanup: std::ptr::null(),
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: std::ptr::null(),
        };
        let mut context: Handle = std::ptr::null_mut();
        // SAFETY: params is a valid ucp_params_t whose mask names only `features`; config came from
        // ucp_config_read and is released right after.
        let status = unsafe { ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut context) };
        // SAFETY: config is the handle ucp_config_read gave, released once.
        unsafe { ucp_config_release(config) };
        check("ucp_init", status)?;
        // SAFETY: all-zero is a valid ucp_worker_params_t (integers and null pointers).
        let mut wp: WorkerParams = unsafe { std::mem::zeroed() };
        wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        wp.thread_mode = thread_mode;
        let mut worker: Handle = std::ptr::null_mut();
        // SAFETY: context is live; wp names only the thread mode.
        let status = unsafe { ucp_worker_create(context, &wp, &mut worker) };
        if let Err(e) = check("ucp_worker_create", status) {
            // SAFETY: the context was created above and nothing else uses it.
            unsafe { ucp_cleanup(context) };
            return Err(e);
        }
        Ok(Node { context, worker })
    }

    fn address(&self) -> Result<Vec<u8>, UcxError> {
        let (mut addr, mut len): (Handle, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: the worker is live; UCX fills addr/len with a buffer we release below.
        check("ucp_worker_get_address", unsafe { ucp_worker_get_address(self.worker, &mut addr, &mut len) })?;
        // SAFETY: UCX returned `len` readable bytes at `addr`.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: addr came from ucp_worker_get_address on this worker, released once.
        unsafe { ucp_worker_release_address(self.worker, addr) };
        Ok(bytes)
    }

    fn progress(&self) -> bool {
        // SAFETY: the worker is live and used by this thread only (Node is not Sync).
        unsafe { ucp_worker_progress(self.worker) != 0 }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // SAFETY: the worker and context were created by Node::new; endpoints, keys and
        // registrations on them are gone before a Node drops (their owners hold it).
        unsafe {
            ucp_worker_destroy(self.worker);
            ucp_cleanup(self.context);
        }
    }
}

/// What a reader needs to read an exporter's memory: its worker address, the packed remote key, the
/// base address and the length. Travels as hex in the transfer handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Blob {
    pub address: Vec<u8>,
    pub rkey: Vec<u8>,
    pub base: u64,
    pub len: u64,
}

impl Blob {
    pub fn to_hex(&self) -> String {
        let mut b = Vec::new();
        for part in [&self.address, &self.rkey] {
            b.extend_from_slice(&(part.len() as u32).to_le_bytes());
            b.extend_from_slice(part);
        }
        b.extend_from_slice(&self.base.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Option<Blob> {
        if !s.len().is_multiple_of(2) || s.len() > 1 << 20 {
            return None;
        }
        let bytes: Vec<u8> = (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
            .collect::<Option<_>>()?;
        let mut at = 0usize;
        let mut take = |n: usize| -> Option<&[u8]> {
            let part = bytes.get(at..at.checked_add(n)?)?;
            at += n;
            Some(part)
        };
        let mut part = || -> Option<Vec<u8>> {
            let n = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
            Some(take(n)?.to_vec())
        };
        let (address, rkey) = (part()?, part()?);
        let base = u64::from_le_bytes(take(8)?.try_into().ok()?);
        let len = u64::from_le_bytes(take(8)?.try_into().ok()?);
        (take(1).is_none() && !address.is_empty() && !rkey.is_empty()).then_some(Blob {
            address,
            rkey,
            base,
            len,
        })
    }
}

/// A mapping registered for remote reads, served by a progress thread until dropped.
pub(crate) struct Exporter {
    blob: Blob,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The memory UCX reads: never unmapped (see `serve`'s end).
    _map: std::mem::ManuallyDrop<super::Mmap>,
}

impl fmt::Debug for Exporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exporter").field("base", &self.blob.base).field("len", &self.blob.len).finish()
    }
}

impl Exporter {
    /// Registers the whole of `map` (kept mapped as long as the exporter lives).
    pub fn new(map: super::Mmap) -> Result<Exporter, UcxError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::sync_channel(1);
        let (flag, addr, len) = (Arc::clone(&stop), map.as_ptr() as usize, map.len());
        let thread = std::thread::Builder::new()
            .name("kv-ucx-export".into())
            .spawn(move || serve(addr, len, &flag, &tx))
            .map_err(|e| UcxError { call: "thread", status: 0, text: e.to_string() })?;
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(blob)) => {
                Ok(Exporter { blob, stop, thread: Some(thread), _map: std::mem::ManuallyDrop::new(map) })
            }
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                // Dead, or stuck in UCX's initialization: the thread is left to itself (it stops
                // with the flag if it ever comes back).
                stop.store(true, Ordering::Relaxed);
                // It may yet register the mapping: that stays mapped, unused, for good.
                std::mem::forget(map);
                Err(UcxError { call: "thread", status: 0, text: "UCX did not start within 30 s".into() })
            }
        }
    }

    pub fn blob(&self) -> &Blob {
        &self.blob
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The exporter's thread: registers the memory, hands back the blob, then progresses the worker
/// (sleeping on its event fd, waking every 100 ms to look at `stop`) until told to stop.
fn serve(base: usize, len: usize, stop: &AtomicBool, tx: &mpsc::SyncSender<Result<Blob, UcxError>>) {
    let node = match Node::new(true, UCS_THREAD_MODE_SINGLE) {
        Ok(n) => n,
        Err(e) => {
            let _ = tx.send(Err(e));
            return;
        }
    };
    let params = MemMapParams {
        field_mask: UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | UCP_MEM_MAP_PARAM_FIELD_PROT,
        address: base as *mut c_void,
        length: len,
        flags: 0,
        // Read-only, as the mapping is: readers may read it, nobody may write it.
        prot: UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_REMOTE_READ,
        memory_type: 0,
    };
    let mut memh: Handle = std::ptr::null_mut();
    // SAFETY: the exporter holds the mapping until this thread has been joined; the registration is
    // undone below before the node drops.
    if let Err(e) = check("ucp_mem_map", unsafe { ucp_mem_map(node.context, &params, &mut memh) }) {
        let _ = tx.send(Err(e));
        return;
    }
    let blob = (|| {
        let (mut buf, mut size): (Handle, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: context and memh are live; UCX fills buf/size, released right after the copy.
        check("ucp_rkey_pack", unsafe { ucp_rkey_pack(node.context, memh, &mut buf, &mut size) })?;
        // SAFETY: UCX returned `size` readable bytes at `buf`.
        let rkey = unsafe { std::slice::from_raw_parts(buf as *const u8, size) }.to_vec();
        // SAFETY: buf came from ucp_rkey_pack, released once.
        unsafe { ucp_rkey_buffer_release(buf) };
        let mut efd: c_int = -1;
        // SAFETY: the worker is live and was created with the wakeup feature.
        check("ucp_worker_get_efd", unsafe { ucp_worker_get_efd(node.worker, &mut efd) })?;
        Ok((Blob { address: node.address()?, rkey, base: base as u64, len: len as u64 }, efd))
    })();
    match blob {
        Ok((blob, efd)) => {
            let _ = tx.send(Ok(blob));
            while !stop.load(Ordering::Relaxed) {
                while node.progress() {}
                // SAFETY: the worker is live and used by this thread only.
                match unsafe { ucp_worker_arm(node.worker) } {
                    UCS_ERR_BUSY => continue,
                    UCS_OK => {
                        let mut pfd = libc::pollfd { fd: efd, events: libc::POLLIN, revents: 0 };
                        // SAFETY: pfd is one valid pollfd; a 100 ms timeout bounds the wait.
                        unsafe { libc::poll(&mut pfd, 1, 100) };
                    }
                    _ => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        }
        Err(e) => {
            let _ = tx.send(Err(e));
        }
    }
    if stop.load(Ordering::Relaxed) {
        // Stopped after serving: readers may have endpoints to this worker still setting up, and
        // UCX 1.13 aborts the process when a worker is destroyed with a connection-setup message
        // queued on one (`ucp_request.c`, "got REP message"), which no amount of progress here
        // clears while the reader is not progressing. An exporter lives as long as its prefill
        // worker, so the worker, the registration and the mapping are left to the process's end.
        settle(&node, Duration::from_millis(100));
        std::mem::forget(node);
        return;
    }
    // SAFETY: memh was registered on this context above and is unregistered once.
    unsafe { ucp_mem_unmap(node.context, memh) };
}

/// Progresses `node` until nothing has happened for 50 ms, `limit` at most.
fn settle(node: &Node, limit: Duration) {
    let until = Instant::now() + limit;
    let mut quiet_since = Instant::now();
    while Instant::now() < until && quiet_since.elapsed() < Duration::from_millis(50) {
        if node.progress() {
            quiet_since = Instant::now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// An endpoint to one exporter and its unpacked remote key.
struct Remote {
    ep: Handle,
    rkey: Handle,
    base: u64,
    len: u64,
}

/// A `get` in flight into a buffer of its own; its bytes can be read once it has completed.
pub(crate) struct Pending {
    request: Handle,
    buf: Vec<u8>,
    failed: bool,
}

// SAFETY: a request handle is only ever used through the Importer that made it (`poll`, `wait`,
// `disconnect`, all &mut), by whichever one thread owns both at the time (the worker is in
// serialized mode).
unsafe impl Send for Pending {}

impl Pending {
    /// The bytes read, once [`Importer::poll`] said the get completed successfully.
    pub fn bytes(&self) -> Option<&[u8]> {
        (self.request.is_null() && !self.failed).then_some(&self.buf[..])
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.request.is_null() {
            // Still in flight: UCX may yet write into the buffer, so it is never freed. The importer
            // waits for a read before it lets one go; this is the last resort.
            std::mem::forget(std::mem::take(&mut self.buf));
        }
    }
}

impl fmt::Debug for Pending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("bytes", &self.buf.len())
            .field("done", &self.request.is_null())
            .finish()
    }
}

/// Endpoints given up while reads on them were in flight, kept this many at most: past it the
/// oldest is closed by force without waiting for its reads (their buffers and its key are leaked).
const CLOSING_MAX: usize = 64;

/// The reading side: one worker, endpoints to exporters by id. Used by one thread at a time.
pub(crate) struct Importer {
    node: Node,
    remotes: std::collections::HashMap<u64, Remote>,
    /// Endpoints given up with reads in flight: the reads end (or fail) before the key and the
    /// endpoint go, progressed by [`reap`](Self::reap), never waited for.
    closing: Vec<(Remote, Vec<Pending>)>,
    /// Endpoint closes still in progress.
    close_requests: Vec<Handle>,
}

// SAFETY: the worker is created in serialized mode and every handle is used only through &mut self,
// so calls never overlap, whichever thread owns the importer.
unsafe impl Send for Importer {}

impl fmt::Debug for Importer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Importer")
            .field("remotes", &self.remotes.len())
            .field("closing", &self.closing.len())
            .finish()
    }
}

impl Importer {
    pub fn new() -> Result<Importer, UcxError> {
        Ok(Importer {
            node: Node::new(false, UCS_THREAD_MODE_SERIALIZED)?,
            remotes: Default::default(),
            closing: Vec::new(),
            close_requests: Vec::new(),
        })
    }

    /// Opens an endpoint to the exporter of `blob` as remote `id`.
    pub fn connect(&mut self, id: u64, blob: &Blob) -> Result<(), UcxError> {
        // SAFETY: all-zero is a valid ucp_ep_params_t (integers and null pointers).
        let mut p: EpParams = unsafe { std::mem::zeroed() };
        p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        p.address = blob.address.as_ptr() as *const c_void;
        p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        let mut ep: Handle = std::ptr::null_mut();
        // SAFETY: the worker is live; the address bytes outlive the call (UCX copies what it keeps).
        check("ucp_ep_create", unsafe { ucp_ep_create(self.node.worker, &p, &mut ep) })?;
        let mut rkey: Handle = std::ptr::null_mut();
        // SAFETY: ep is live; the packed key bytes outlive the call.
        let status = unsafe { ucp_ep_rkey_unpack(ep, blob.rkey.as_ptr() as *const c_void, &mut rkey) };
        if let Err(e) = check("ucp_ep_rkey_unpack", status) {
            self.close_ep(ep);
            return Err(e);
        }
        self.remotes.insert(id, Remote { ep, rkey, base: blob.base, len: blob.len });
        Ok(())
    }

    /// Starts reading `len` bytes at `offset` of remote `id`'s memory.
    pub fn get(&mut self, id: u64, offset: u64, len: usize) -> Result<Pending, UcxError> {
        let bad = |text: String| UcxError { call: "get", status: 0, text };
        let r = self.remotes.get(&id).ok_or_else(|| bad(format!("no endpoint {id}")))?;
        if offset.checked_add(len as u64).is_none_or(|end| end > r.len) {
            return Err(bad(format!("{len} bytes at {offset} are outside the exporter's {} bytes", r.len)));
        }
        let mut buf = vec![0u8; len];
        let param = RequestParam::none();
        // SAFETY: ep and rkey are live; the range is inside the registered memory (checked above);
        // `buf` is `len` writable bytes that stay put (the Vec is never resized, and a Pending whose
        // request is live never frees it) until the request has completed.
        let req = unsafe {
            ucp_get_nbx(r.ep, buf.as_mut_ptr() as *mut c_void, len, r.base + offset, r.rkey, &param)
        };
        match ptr_status(req) {
            Some(UCS_OK) => Ok(Pending { request: std::ptr::null_mut(), buf, failed: false }),
            Some(s) => Err(check("ucp_get_nbx", s).err().unwrap_or_else(|| bad("unknown status".into()))),
            None => Ok(Pending { request: req, buf, failed: false }),
        }
    }

    /// Progresses the worker once; true if anything happened.
    pub fn progress(&mut self) -> bool {
        self.node.progress()
    }

    /// Whether `p` is done: `Some(Ok)` with its bytes in [`Pending::bytes`], `Some(Err)`, or `None`
    /// (in flight).
    pub fn poll(&mut self, p: &mut Pending) -> Option<Result<(), UcxError>> {
        if p.request.is_null() {
            return Some(if p.failed {
                Err(UcxError { call: "get", status: 0, text: "failed".into() })
            } else {
                Ok(())
            });
        }
        // SAFETY: the request came from ucp_get_nbx and has not been freed.
        let status = unsafe { ucp_request_check_status(p.request) };
        if status == UCS_INPROGRESS {
            return None;
        }
        // SAFETY: the request is complete and freed once; the pointer is cleared.
        unsafe { ucp_request_free(p.request) };
        p.request = std::ptr::null_mut();
        p.failed = status != UCS_OK;
        Some(check("get", status))
    }

    /// Progresses until every one of `pending` is done or `budget` has passed.
    pub fn wait(&mut self, pending: &mut [&mut Pending], budget: Duration) {
        let until = Instant::now() + budget;
        loop {
            while self.progress() {}
            let done = pending.iter().all(|p| {
                // SAFETY: a non-null request came from ucp_get_nbx and has not been freed.
                p.request.is_null() || unsafe { ucp_request_check_status(p.request) } != UCS_INPROGRESS
            });
            if done || Instant::now() >= until {
                return;
            }
        }
    }

    /// Gives up remote `id` and the reads on it. Nothing waits: the endpoint is parked until its
    /// reads end (a dead peer's fail at once, UCX's error handling sees to it), then its key and
    /// endpoint go ([`reap`](Self::reap), called by every later poll).
    pub fn disconnect(&mut self, id: u64, pending: Vec<Pending>) {
        match self.remotes.remove(&id) {
            Some(r) => self.closing.push((r, pending)),
            None => drop(pending),
        }
        self.reap();
        if self.closing.len() > CLOSING_MAX {
            // A peer that never answers: close its endpoint by force (UCX cancels its reads) and
            // leave its key and buffers behind rather than free what UCX may still touch.
            let (r, pending) = self.closing.remove(0);
            drop(pending);
            self.close_ep(r.ep);
        }
    }

    /// Progresses the worker (connection setup with exporters needs this side's answers too) and
    /// frees finished reads of given-up endpoints; an endpoint whose reads have all ended loses its
    /// key and is closed. Never waits.
    pub fn reap(&mut self) {
        if self.remotes.is_empty() && self.closing.is_empty() && self.close_requests.is_empty() {
            return;
        }
        while self.progress() {}
        let mut i = 0;
        while i < self.closing.len() {
            let mut pending = std::mem::take(&mut self.closing[i].1);
            pending.retain_mut(|p| self.poll(p).is_none());
            if pending.is_empty() {
                let (r, _) = self.closing.swap_remove(i);
                // SAFETY: every operation with this key has ended; it is destroyed once, before its
                // endpoint is closed.
                unsafe { ucp_rkey_destroy(r.rkey) };
                self.close_ep(r.ep);
            } else {
                self.closing[i].1 = pending;
                i += 1;
            }
        }
        self.close_requests.retain(|&req| {
            // SAFETY: req came from ucp_ep_close_nbx and has not been freed.
            if unsafe { ucp_request_check_status(req) } == UCS_INPROGRESS {
                return true;
            }
            // SAFETY: complete, freed once.
            unsafe { ucp_request_free(req) };
            false
        });
    }

    /// Closes `ep` by force without waiting (a close still in progress is finished by `reap`).
    fn close_ep(&mut self, ep: Handle) {
        let mut param = RequestParam::none();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: ep is live and closed once.
        let req = unsafe { ucp_ep_close_nbx(ep, &param) };
        if ptr_status(req).is_none() {
            self.close_requests.push(req);
        }
    }
}

impl Drop for Importer {
    fn drop(&mut self) {
        let ids: Vec<u64> = self.remotes.keys().copied().collect();
        for id in ids {
            self.disconnect(id, Vec::new());
        }
        let until = Instant::now() + Duration::from_secs(1);
        while !(self.closing.is_empty() && self.close_requests.is_empty()) && Instant::now() < until {
            self.reap();
        }
        // Whatever still waits: closed by force, keys and buffers left behind (see `disconnect`).
        for (r, pending) in std::mem::take(&mut self.closing) {
            drop(pending);
            self.close_ep(r.ep);
        }
        // The closes finish before the worker goes: UCX 1.13 aborts the process when a worker is
        // destroyed under an endpoint still exchanging connection messages.
        let until = Instant::now() + Duration::from_secs(1);
        while !self.close_requests.is_empty() && Instant::now() < until {
            self.reap();
        }
        for req in std::mem::take(&mut self.close_requests) {
            // SAFETY: freeing a request still in progress releases it when it completes (ucp.h).
            unsafe { ucp_request_free(req) };
        }
        settle(&self.node, Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_round_trip_and_refuse_garbage() {
        let b = Blob { address: vec![1, 2, 3], rkey: vec![9; 40], base: 0x7f00_0000_1000, len: 1 << 20 };
        assert_eq!(Blob::from_hex(&b.to_hex()), Some(b.clone()));
        let hex = b.to_hex();
        for bad in ["", "zz", &hex[..hex.len() - 2], &format!("{hex}00"), "0000000000000000"] {
            assert_eq!(Blob::from_hex(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_get_reads_exported_memory() {
        let data: Vec<u8> = (0..1 << 16).map(|i| (i * 7 % 251) as u8).collect();
        let path = std::env::temp_dir().join(format!("pdserve-ucx-test-{}", std::process::id()));
        std::fs::write(&path, &data).unwrap();
        let map = super::super::map_read_only(&std::fs::File::open(&path).unwrap()).unwrap();
        let _ = std::fs::remove_file(&path);
        let ex = Exporter::new(map).expect("export");
        let blob = Blob::from_hex(&ex.blob().to_hex()).unwrap();
        let mut im = Importer::new().expect("import");
        im.connect(1, &blob).expect("connect");
        let mut p = im.get(1, 4096, 8192).expect("get");
        im.wait(&mut [&mut p], Duration::from_secs(5));
        assert_eq!(im.poll(&mut p), Some(Ok(())));
        assert_eq!(p.bytes(), Some(&data[4096..4096 + 8192]));
        assert!(im.get(1, (1 << 16) - 10, 11).is_err(), "a read past the end is refused");
        im.disconnect(1, Vec::new());
        // Endpoints to the same exporter come and go, one per transfer.
        for id in 2..6 {
            im.connect(id, &blob).expect("connect again");
            let mut p = im.get(id, 0, 4096).expect("get");
            im.wait(&mut [&mut p], Duration::from_secs(5));
            assert_eq!(im.poll(&mut p), Some(Ok(())));
            assert_eq!(p.bytes(), Some(&data[..4096]));
            im.disconnect(id, Vec::new());
        }
        // One given up with reads in flight, then another.
        im.connect(7, &blob).expect("connect");
        let pending = (0..8).map(|i| im.get(7, i * 4096, 4096).expect("get")).collect();
        im.disconnect(7, pending);
        im.connect(8, &blob).expect("connect after a disconnect with reads in flight");
        let mut p = im.get(8, 0, 4096).expect("get");
        im.wait(&mut [&mut p], Duration::from_secs(5));
        assert_eq!(im.poll(&mut p), Some(Ok(())));
    }
}
