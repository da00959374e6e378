//! UCX 1.13's `ucp.h`/`ucp_def.h` as far as the transport needs them: the parameter structs (sizes
//! checked at compile time against the C header's), the constants, the functions, and the error type.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::fmt;
use std::io;

pub(super) type Status = c_int;
pub(super) type Handle = *mut c_void;

pub(super) const UCS_OK: Status = 0;
pub(super) const UCS_INPROGRESS: Status = 1;
pub(super) const UCS_ERR_BUSY: Status = -15;
pub(super) const UCS_ERR_LAST: isize = -100;

pub(super) const UCP_API_MAJOR: c_uint = 1;
pub(super) const UCP_API_MINOR: c_uint = 13;
pub(super) const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub(super) const UCP_FEATURE_RMA: u64 = 1 << 1;
pub(super) const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub(super) const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub(super) const UCS_THREAD_MODE_SINGLE: c_int = 0;
pub(super) const UCS_THREAD_MODE_SERIALIZED: c_int = 1;
pub(super) const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(super) const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub(super) const UCP_MEM_MAP_PARAM_FIELD_PROT: u64 = 1 << 3;
pub(super) const UCP_MEM_MAP_PROT_LOCAL_READ: c_uint = 1 << 0;
pub(super) const UCP_MEM_MAP_PROT_REMOTE_READ: c_uint = 1 << 8;
pub(super) const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub(super) const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub(super) const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub(super) const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub(super) const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

#[repr(C)]
pub(super) struct UcpParams {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *const c_void,
    pub request_cleanup: *const c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

#[repr(C)]
pub(super) struct WorkerParams {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub cpu_mask: [u64; 16],
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

#[repr(C)]
pub(super) struct MemMapParams {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
}

#[repr(C)]
pub(super) struct SockAddr {
    pub addr: *const c_void,
    pub addrlen: u32,
}

#[repr(C)]
pub(super) struct EpParams {
    pub field_mask: u64,
    pub address: *const c_void,
    pub err_mode: c_int,
    pub err_handler_cb: *const c_void,
    pub err_handler_arg: *mut c_void,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: SockAddr,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: SockAddr,
}

#[repr(C)]
pub(super) struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: *const c_void,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: *mut c_void,
}

const _: () = {
    assert!(size_of::<UcpParams>() == 80);
    assert!(size_of::<WorkerParams>() == 200);
    assert!(size_of::<MemMapParams>() == 40);
    assert!(size_of::<EpParams>() == 104);
    assert!(size_of::<RequestParam>() == 72);
};

impl RequestParam {
    pub(super) fn none() -> RequestParam {
        // SAFETY: every field is an integer or a raw pointer, for which all-zero is valid (0, null).
        unsafe { std::mem::zeroed() }
    }
}

#[link(name = "ucp")]
extern "C" {
    pub(super) fn ucp_config_read(
        env_prefix: *const c_char,
        filename: *const c_char,
        config_p: *mut Handle,
    ) -> Status;
    pub(super) fn ucp_config_release(config: Handle);
    pub(super) fn ucp_init_version(
        api_major: c_uint,
        api_minor: c_uint,
        params: *const UcpParams,
        config: Handle,
        context_p: *mut Handle,
    ) -> Status;
    pub(super) fn ucp_cleanup(context: Handle);
    pub(super) fn ucp_worker_create(
        context: Handle,
        params: *const WorkerParams,
        worker_p: *mut Handle,
    ) -> Status;
    pub(super) fn ucp_worker_destroy(worker: Handle);
    pub(super) fn ucp_worker_get_address(
        worker: Handle,
        address_p: *mut Handle,
        length_p: *mut usize,
    ) -> Status;
    pub(super) fn ucp_worker_release_address(worker: Handle, address: Handle);
    pub(super) fn ucp_worker_progress(worker: Handle) -> c_uint;
    pub(super) fn ucp_worker_get_efd(worker: Handle, fd: *mut c_int) -> Status;
    pub(super) fn ucp_worker_arm(worker: Handle) -> Status;
    pub(super) fn ucp_mem_map(context: Handle, params: *const MemMapParams, memh_p: *mut Handle) -> Status;
    pub(super) fn ucp_mem_unmap(context: Handle, memh: Handle) -> Status;
    pub(super) fn ucp_rkey_pack(
        context: Handle,
        memh: Handle,
        rkey_buffer_p: *mut Handle,
        size_p: *mut usize,
    ) -> Status;
    pub(super) fn ucp_rkey_buffer_release(rkey_buffer: Handle);
    pub(super) fn ucp_ep_create(worker: Handle, params: *const EpParams, ep_p: *mut Handle) -> Status;
    pub(super) fn ucp_ep_close_nbx(ep: Handle, param: *const RequestParam) -> Handle;
    pub(super) fn ucp_ep_rkey_unpack(ep: Handle, rkey_buffer: *const c_void, rkey_p: *mut Handle) -> Status;
    pub(super) fn ucp_rkey_destroy(rkey: Handle);
    pub(super) fn ucp_get_nbx(
        ep: Handle,
        buffer: *mut c_void,
        count: usize,
        remote_addr: u64,
        rkey: Handle,
        param: *const RequestParam,
    ) -> Handle;
    pub(super) fn ucp_request_check_status(request: Handle) -> Status;
    pub(super) fn ucp_request_free(request: Handle);
}

#[link(name = "ucs")]
extern "C" {
    pub(super) fn ucs_status_string(status: Status) -> *const c_char;
}

/// A UCX call that failed, with UCX's own words for why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UcxError {
    pub call: &'static str,
    pub status: i32,
    pub text: String,
}

impl fmt::Display for UcxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UCX {} failed: {} ({})", self.call, self.text, self.status)
    }
}

impl From<UcxError> for io::Error {
    fn from(e: UcxError) -> io::Error {
        io::Error::other(e.to_string())
    }
}

pub(super) fn check(call: &'static str, status: Status) -> Result<(), UcxError> {
    if status == UCS_OK {
        return Ok(());
    }
    // SAFETY: ucs_status_string returns a static, NUL-terminated string for any status value.
    let text = unsafe { CStr::from_ptr(ucs_status_string(status)) }.to_string_lossy().into_owned();
    Err(UcxError { call, status, text })
}

/// A request pointer's status as UCS_PTR_STATUS reads it: null is done, an error code is an error.
pub(super) fn ptr_status(p: Handle) -> Option<Status> {
    let v = p as isize;
    if p.is_null() {
        Some(UCS_OK)
    } else if (UCS_ERR_LAST..0).contains(&v) {
        Some(v as Status)
    } else {
        None
    }
}
