//! Raw bindings to libfabric, generated at build time from the installed headers.
//!
//! Nothing but bindings lives here: the safe owners are in `fabric_ep::fabric`.
//! Static-inline calls such as `fi_domain`, `fi_endpoint`, `fi_writemsg` and `fi_cq_read`
//! are real symbols here through bindgen's `wrap_static_fns` shims.
#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case, dead_code)]
#![allow(clippy::all)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// `FI_VERSION(major, minor)` is a macro in C.
pub const fn make_version(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}
