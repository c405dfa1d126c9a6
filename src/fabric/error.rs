//! Errors from libfabric: every variant names the call, its code and libfabric's own text.

use std::ffi::CStr;
use std::time::Duration;

use libfabric_sys as sys;

/// An error from the libfabric layer.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    /// A libfabric call returned a negative code.
    #[error("{call} failed: {text} (code {code}){}", ctx_suffix(.context))]
    Call { call: &'static str, code: i32, text: String, context: String },
    /// `fi_getinfo` found nothing that offers what EP needs.
    #[error(
        "no libfabric provider matches provider={provider:?} with FI_EP_RDM, FI_MSG|FI_RMA, \
         remote write and remote CQ data{}: {text}; `fi_info -l` lists the installed providers",
        if *.hmem { " and FI_HMEM" } else { "" }
    )]
    NoProvider { provider: String, hmem: bool, text: String },
    /// A completion-error entry (`fi_cq_readerr`), decoded with `fi_cq_strerror`. `flags` are
    /// the entry's `FI_*` flags: on the target side of a peer's write (`op_context` 0, or
    /// `FI_REMOTE_WRITE`) the entry names no peer, since libfabric's error entries carry no
    /// source address.
    #[error(
        "completion error: {text} (err {err}, prov_errno {prov_errno}, op context {op_context:#x}, \
         len {len}{})", completion_side(*.op_context, *.flags)
    )]
    Completion { err: i32, prov_errno: i32, text: String, op_context: u64, len: usize, flags: u64 },
    /// A bounded wait ran out.
    #[error("timed out after {waited:?} {what}")]
    Timeout { what: String, waited: Duration },
    /// Bad input to this layer, naming the argument.
    #[error("invalid argument `{arg}`: {msg}")]
    InvalidArgument { arg: &'static str, msg: String },
    /// The provider lacks something EP relies on.
    #[error("provider {provider} unsupported: {msg}")]
    Unsupported { provider: String, msg: String },
}

/// Flags of a completion that belongs to the target side of a peer's operation.
const TARGET_SIDE_FLAGS: u64 = sys::FI_REMOTE_WRITE as u64 | sys::FI_REMOTE_READ as u64;

fn completion_side(op_context: u64, flags: u64) -> &'static str {
    if op_context == 0 || flags & TARGET_SIDE_FLAGS != 0 {
        ", target side of a peer's operation"
    } else {
        ""
    }
}

fn ctx_suffix(ctx: &str) -> String {
    if ctx.is_empty() {
        String::new()
    } else {
        format!(" [{ctx}]")
    }
}

pub type Result<T, E = FabricError> = std::result::Result<T, E>;

/// libfabric's text for a (positive) error number.
pub fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror returns a pointer to a static string for any input.
    unsafe {
        let p = sys::fi_strerror(code.abs());
        if p.is_null() {
            format!("error {code}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

impl FabricError {
    pub(crate) fn call(call: &'static str, ret: i64, context: impl Into<String>) -> Self {
        let code = ret as i32;
        FabricError::Call { call, code, text: strerror(code), context: context.into() }
    }

    pub(crate) fn arg(arg: &'static str, msg: impl Into<String>) -> Self {
        FabricError::InvalidArgument { arg, msg: msg.into() }
    }

    /// A completion error on the target side of a peer's operation (a remote write landing
    /// here): nothing in it names the peer.
    pub fn is_target_side(&self) -> bool {
        matches!(self, FabricError::Completion { op_context, flags, .. }
            if *op_context == 0 || flags & TARGET_SIDE_FLAGS != 0)
    }

    /// True for `-FI_EAGAIN` returned by a call.
    pub fn is_again(&self) -> bool {
        matches!(self, FabricError::Call { code, .. } if *code == -(sys::FI_EAGAIN as i32))
    }
}

/// Turn a libfabric return code (0 or positive = success) into a `Result`.
pub(crate) fn check(call: &'static str, ret: i64) -> Result<i64> {
    if ret < 0 {
        Err(FabricError::call(call, ret, ""))
    } else {
        Ok(ret)
    }
}

/// As [`check`], with context (peer rank, sizes) in the error.
pub(crate) fn check_ctx(call: &'static str, ret: i64, ctx: impl FnOnce() -> String) -> Result<i64> {
    if ret < 0 {
        Err(FabricError::call(call, ret, ctx()))
    } else {
        Ok(ret)
    }
}

pub(crate) const EAGAIN: i64 = -(sys::FI_EAGAIN as i64);
pub(crate) const EAVAIL: i64 = -(sys::FI_EAVAIL as i64);
