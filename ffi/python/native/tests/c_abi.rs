//! The C ABI's versioned configuration as a C caller sees it (the Python package builds its
//! `fep_config` through `fep_config_init` only, so these cases need a raw caller): the 80-byte
//! first-release `fep_config` is still accepted with the same size hints, and a short or
//! wrong-version one is refused naming `cfg`.

use std::ffi::CStr;
use std::mem::MaybeUninit;

use fabric_ep::ffi::{self as c, fep_config, fep_size_hints};

fn small_cfg() -> fep_config {
    let mut cfg = MaybeUninit::<fep_config>::zeroed();
    // SAFETY: a writable config, filled by the library.
    assert_eq!(unsafe { c::fep_config_init(cfg.as_mut_ptr()) }, c::FEP_OK);
    // SAFETY: initialised above.
    let mut cfg = unsafe { cfg.assume_init() };
    cfg.rank = 0;
    cfg.num_ranks = 1;
    cfg.ranks_per_node = 1;
    cfg.local_rank = 0;
    cfg.num_experts = 8;
    cfg.hidden = 256;
    cfg.num_topk = 2;
    cfg.provider = c"shm".as_ptr();
    cfg
}

fn hints(cfg: *const fep_config) -> (c::fep_status, fep_size_hints) {
    let mut out = fep_size_hints::default();
    // SAFETY: `cfg` points at at least `struct_size` readable bytes; `out` is writable.
    let st = unsafe { c::fep_get_size_hints(cfg, &mut out) };
    (st, out)
}

fn last_error() -> String {
    // SAFETY: the library's thread-local message, NUL-terminated.
    unsafe { CStr::from_ptr(c::fep_last_error()) }.to_string_lossy().into_owned()
}

#[test]
fn config_init_fills_size_version_and_device() {
    let cfg = small_cfg();
    assert_eq!(cfg.struct_size as usize, std::mem::size_of::<fep_config>());
    assert!(cfg.struct_size > c::FEP_CONFIG_V1_SIZE);
    assert_eq!(cfg.version, c::FEP_ABI_VERSION);
    assert_eq!((cfg.device, cfg.gpu_reserve_tokens, cfg.internode_hierarchy), (-1, 0, 0));
}

#[test]
fn first_release_config_size_is_still_accepted() {
    let full = small_cfg();
    let (st, want) = hints(&full);
    assert_eq!(st, c::FEP_OK, "{}", last_error());
    // A caller compiled against the first header: 80 bytes, no device field after them.
    let mut v1 = [0u8; c::FEP_CONFIG_V1_SIZE as usize];
    // SAFETY: the first 80 bytes of a live config.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (&full as *const fep_config).cast::<u8>(),
            v1.as_mut_ptr(),
            v1.len(),
        )
    };
    v1[..4].copy_from_slice(&c::FEP_CONFIG_V1_SIZE.to_ne_bytes());
    let (st, got) = hints(v1.as_ptr().cast());
    assert_eq!(st, c::FEP_OK, "{}", last_error());
    assert_eq!((got.normal_bytes, got.ll_bytes), (want.normal_bytes, want.ll_bytes));
}

#[test]
fn short_or_wrong_version_config_is_refused_naming_cfg() {
    for (size, version) in [(c::FEP_CONFIG_V1_SIZE - 4, 1), (96, 2), (96, 0)] {
        let mut cfg = small_cfg();
        cfg.struct_size = size;
        cfg.version = version;
        let (st, _) = hints(&cfg);
        assert_eq!(st, c::FEP_ERR_INVALID_ARGUMENT, "size {size} version {version}");
        assert!(last_error().contains("`cfg`"), "{}", last_error());
    }
}
