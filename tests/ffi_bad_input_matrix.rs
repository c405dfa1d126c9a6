//! Every `fep_*` entry point of the C ABI against each class of bad argument, each case in a
//! child process (this test binary re-executed with `FEP_BAD_INPUT_CASE` naming the case) with
//! a deadline, so a crash, an abort or a hang of one case is seen and counted as such instead
//! of taking the suite down. A bad input must come back as an error whose message names the
//! argument; a few valid edge inputs (no tokens, one token, every `topk_idx` -1) must be
//! accepted, so the suite also fails when the library refuses too much.
//!
//! `FEP_BAD_INPUT_ONLY=substring` runs the cases whose name contains it; `FEP_BAD_INPUT_JOBS`
//! sets how many children run at once (default 8: most of a child's time is process start and
//! the shm endpoint's set-up, not CPU).

use std::ffi::{c_void, CStr, CString};
use std::io::{Read, Write};
use std::os::raw::{c_char, c_int};
use std::process::{Command, Stdio};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fabric_ep::ffi::*;

const CASE_VAR: &str = "FEP_BAD_INPUT_CASE";
const DEADLINE: Duration = Duration::from_secs(20);
const RESULT_TAG: &str = "@@FEP-RESULT ";
const SETUP_TAG: &str = "@@FEP-SETUP ";

// ---------------------------------------------------------------------------------------------
// What a case expects and what it got
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy)]
enum Want {
    /// `FEP_ERR_INVALID_ARGUMENT` with a message naming one of these.
    Refuse(&'static [&'static str]),
    /// This status (not OK) with a message naming one of these.
    Fail(fep_status, &'static [&'static str]),
    /// A valid input: `FEP_OK`.
    Accept,
    /// Either a clean refusal naming one of these, or success (limits that depend on the
    /// machine, e.g. whether a large buffer can be allocated).
    Bounded(&'static [&'static str]),
}

/// What the child saw: the status and the thread's last error.
struct Got {
    st: i32,
    msg: String,
}

type Run = Box<dyn Fn() -> Got + Send + Sync>;

struct Case {
    name: String,
    want: Want,
    run: Run,
}

fn case(
    cases: &mut Vec<Case>,
    name: impl Into<String>,
    want: Want,
    run: impl Fn() -> Got + Send + Sync + 'static,
) {
    cases.push(Case { name: name.into(), want, run: Box::new(run) });
}

fn last_error() -> String {
    unsafe { CStr::from_ptr(fep_last_error()) }.to_string_lossy().into_owned()
}

fn got(st: fep_status) -> Got {
    Got { st: st as i32, msg: last_error() }
}

/// A `_destroy` call returns nothing: a refusal is its last-error message (cleared first).
fn got_void(f: impl FnOnce()) -> Got {
    clear_error();
    f();
    let msg = last_error();
    Got { st: if msg.is_empty() { 0 } else { FEP_ERR_INVALID_ARGUMENT as i32 }, msg }
}

fn clear_error() {
    let mut c = std::mem::MaybeUninit::<fep_config>::uninit();
    unsafe { fep_config_init(c.as_mut_ptr()) };
}

/// The set-up of a case failed (not the call under test): reported apart, and a failure.
fn setup(st: fep_status, what: &str) {
    if st != FEP_OK {
        println!("\n{SETUP_TAG}{what}: {st:?}: {}", last_error());
        std::process::exit(3);
    }
}

// ---------------------------------------------------------------------------------------------
// Fixtures built inside a child
// ---------------------------------------------------------------------------------------------

const H: i64 = 256;
const K: i64 = 2;
const E: i32 = 8;
const MAXT: i32 = 16;

unsafe extern "C" fn copy_gather(
    send: *const c_void,
    len: usize,
    recv: *mut c_void,
    _u: *mut c_void,
) -> c_int {
    std::ptr::copy_nonoverlapping(send.cast::<u8>(), recv.cast::<u8>(), len);
    0
}

unsafe extern "C" fn failing_gather(
    _s: *const c_void,
    _l: usize,
    _r: *mut c_void,
    _u: *mut c_void,
) -> c_int {
    -5
}

fn config() -> fep_config {
    let mut c = std::mem::MaybeUninit::<fep_config>::uninit();
    unsafe {
        setup(fep_config_init(c.as_mut_ptr()), "fep_config_init");
        let mut c = c.assume_init();
        c.rank = 0;
        c.num_ranks = 1;
        c.ranks_per_node = 1;
        c.local_rank = 0;
        c.num_experts = E;
        c.hidden = H as i32;
        c.num_topk = K as i32;
        c.max_tokens_per_rank = MAXT;
        c.timeout_s = 10.0;
        c
    }
}

fn create(c: &fep_config) -> (fep_status, *mut fep_buffer) {
    let mut b = null_mut();
    let st = unsafe { fep_buffer_create(c, Some(copy_gather), null_mut(), &mut b) };
    (st, b)
}

fn buffer() -> *mut fep_buffer {
    let (st, b) = create(&config());
    setup(st, "fep_buffer_create");
    b
}

/// A buffer that dispatches fp8 (normal mode takes fp8 tokens only there).
fn fp8_buffer() -> *mut fep_buffer {
    let mut c = config();
    c.dispatch_dtype = FEP_DTYPE_FP8_E4M3;
    let (st, b) = create(&c);
    setup(st, "fep_buffer_create (fp8)");
    b
}

fn destroyed_buffer() -> *mut fep_buffer {
    let b = buffer();
    setup(unsafe { fep_buffer_destroy(b) }, "fep_buffer_destroy");
    b
}

/// A dense tensor over its own (8-byte aligned, one word longer) storage.
struct Ten {
    _store: Vec<u64>,
    t: fep_tensor,
}

fn elem(dtype: i32) -> usize {
    match dtype {
        FEP_DTYPE_BF16 => 2,
        FEP_DTYPE_FP8_E4M3 | FEP_DTYPE_BOOL => 1,
        FEP_DTYPE_F32 | FEP_DTYPE_I32 => 4,
        _ => 8,
    }
}

fn ten(dtype: i32, shape: &[i64]) -> Ten {
    let n: i64 = shape.iter().product();
    let bytes = n.max(0) as usize * elem(dtype);
    let mut store = vec![0u64; bytes / 8 + 2];
    let mut s = [0i64; 4];
    s[..shape.len()].copy_from_slice(shape);
    let t =
        fep_tensor { data: store.as_mut_ptr().cast(), dtype, ndim: shape.len() as i32, shape: s };
    Ten { _store: store, t }
}

fn ten_of<T: Copy>(dtype: i32, shape: &[i64], vals: &[T]) -> Ten {
    let t = ten(dtype, shape);
    assert_eq!(std::mem::size_of::<T>(), elem(dtype));
    unsafe { std::ptr::copy_nonoverlapping(vals.as_ptr(), t.t.data.cast::<T>(), vals.len()) };
    t
}

fn x_bf16(t: i64) -> Ten {
    let v: Vec<u16> = (0..t * H).map(|i| 0x3f80 + (i % 7) as u16).collect();
    ten_of(FEP_DTYPE_BF16, &[t, H], &v)
}

fn x_fp8(t: i64) -> (Ten, Ten) {
    let v: Vec<u8> = (0..t * H).map(|i| (i % 90) as u8).collect();
    let s = vec![0.5f32; (t * H / 128) as usize];
    (ten_of(FEP_DTYPE_FP8_E4M3, &[t, H], &v), ten_of(FEP_DTYPE_F32, &[t, H / 128], &s))
}

/// Top-2 routing of `t` tokens over the 8 experts (distinct per token).
fn idx(t: i64) -> Ten {
    let v: Vec<i64> = (0..t).flat_map(|i| [i % E as i64, (i + 3) % E as i64]).collect();
    ten_of(FEP_DTYPE_I64, &[t, K], &v)
}

fn idx_of(t: i64, v: &[i64]) -> Ten {
    ten_of(FEP_DTYPE_I64, &[t, K], v)
}

fn weights(t: i64) -> Ten {
    ten_of(FEP_DTYPE_F32, &[t, K], &vec![0.5f32; (t * K) as usize])
}

fn weights_of(t: i64, v: &[f32]) -> Ten {
    ten_of(FEP_DTYPE_F32, &[t, K], v)
}

/// A completed fresh dispatch of `t` tokens (bf16 or fp8): the handle and its row count.
fn dispatched(b: *mut fep_buffer, t: i64, fp8: bool) -> (*mut fep_handle, i64) {
    let (xi, wi) = (idx(t), weights(t));
    let (mut h, mut rows) = (null_mut(), 0i64);
    let st = if fp8 {
        let (x, s) = x_fp8(t);
        unsafe {
            fep_dispatch(b, &x.t, &s.t, &xi.t, &wi.t, null(), 1, 0, null_mut(), &mut h, &mut rows)
        }
    } else {
        let x = x_bf16(t);
        unsafe {
            fep_dispatch(b, &x.t, null(), &xi.t, &wi.t, null(), 1, 0, null_mut(), &mut h, &mut rows)
        }
    };
    setup(st, "fep_dispatch");
    (h, rows)
}

/// A completed low-latency dispatch of `t` tokens.
fn ll_dispatched(b: *mut fep_buffer, t: i64, fp8: bool) -> *mut fep_ll_op {
    let (x, i) = (x_bf16(t), idx(t));
    let mut op = null_mut();
    setup(
        unsafe { fep_low_latency_dispatch(b, &x.t, &i.t, fp8, false, false, null_mut(), &mut op) },
        "fep_low_latency_dispatch",
    );
    op
}

const L: i64 = E as i64; // world 1: every expert is local
const S: i64 = MAXT as i64; // num_ranks * max_tokens_per_rank

/// A completed low-latency combine of `t` tokens (its dispatch freed).
fn ll_combined(b: *mut fep_buffer, t: i64) -> *mut fep_ll_op {
    let d = ll_dispatched(b, t, false);
    let (x, i, w) = (ten(FEP_DTYPE_BF16, &[L, S, H]), idx(t), weights(t));
    let mut op = null_mut();
    setup(
        unsafe { fep_low_latency_combine(b, d, &x.t, &i.t, &w.t, false, null_mut(), &mut op) },
        "fep_low_latency_combine",
    );
    unsafe { fep_ll_op_destroy(d) };
    op
}

// ---------------------------------------------------------------------------------------------
// Tensor mutations
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Mutation {
    Null,
    NullData,
    WrongDtype,
    UnknownDtype,
    NdimLess,
    NdimMore,
    NdimNegative,
    NdimFive,
    NegativeDim,
    WrongExtent,
    Overflow,
    Huge,
    Misaligned,
}

const MUTATIONS: [Mutation; 13] = [
    Mutation::Null,
    Mutation::NullData,
    Mutation::WrongDtype,
    Mutation::UnknownDtype,
    Mutation::NdimLess,
    Mutation::NdimMore,
    Mutation::NdimNegative,
    Mutation::NdimFive,
    Mutation::NegativeDim,
    Mutation::WrongExtent,
    Mutation::Overflow,
    Mutation::Huge,
    Mutation::Misaligned,
];

impl Mutation {
    /// Whether this mutation is bad input for a tensor of `dtype` (a byte tensor cannot be
    /// misaligned; NULL is fine for an optional one).
    fn applies(self, dtype: i32) -> bool {
        !matches!(self, Mutation::Misaligned) || elem(dtype) > 1
    }

    /// Applies it; the pointer to pass (NULL for `Null`).
    fn apply(self, t: &mut Ten) -> *mut fep_tensor {
        let nd = t.t.ndim as usize;
        match self {
            Mutation::Null => return null_mut(),
            Mutation::NullData => t.t.data = null_mut(),
            Mutation::WrongDtype => {
                t.t.dtype = if t.t.dtype == FEP_DTYPE_I32 { FEP_DTYPE_I64 } else { FEP_DTYPE_I32 }
            }
            Mutation::UnknownDtype => t.t.dtype = 99,
            Mutation::NdimLess => t.t.ndim -= 1,
            Mutation::NdimMore => {
                if nd < 4 {
                    t.t.shape[nd] = 1;
                }
                t.t.ndim += 1
            }
            Mutation::NdimNegative => t.t.ndim = -1,
            Mutation::NdimFive => t.t.ndim = 5,
            Mutation::NegativeDim => t.t.shape[0] = -t.t.shape[0].max(1),
            Mutation::WrongExtent => t.t.shape[nd - 1] += 1,
            Mutation::Overflow => t.t.shape[..nd].iter_mut().for_each(|d| *d = i64::MAX / 3),
            Mutation::Huge => t.t.shape[0] = 1 << 55,
            Mutation::Misaligned => t.t.data = unsafe { t.t.data.cast::<u8>().add(1) }.cast(),
        }
        &mut t.t
    }
}

/// One case per (mutation, tensor) of a call: `make` builds the call's fixture and tensors
/// (`tensors[i]` is the one mutated, by position in `names`) and runs the call on them.
fn tensor_matrix<F>(
    cases: &mut Vec<Case>,
    call: &'static str,
    names: &'static [(&'static str, i32, bool)],
    make: F,
) where
    F: Fn(usize, Mutation) -> Got + Send + Sync + Clone + 'static,
{
    for (i, &(name, dtype, optional)) in names.iter().enumerate() {
        for m in MUTATIONS {
            if !m.applies(dtype) {
                continue;
            }
            let want = if optional && matches!(m, Mutation::Null) {
                Want::Accept
            } else {
                Want::Refuse(std::slice::from_ref(&names[i].0))
            };
            let make = make.clone();
            case(cases, format!("{call}/{name}/{m:?}"), want, move || make(i, m));
        }
    }
}

/// Pointer to tensor `i` of `ts`, mutated when `i == which`.
fn ptrs(ts: &mut [Ten], which: usize, m: Mutation) -> Vec<*mut fep_tensor> {
    ts.iter_mut()
        .enumerate()
        .map(|(i, t)| if i == which { m.apply(t) } else { &mut t.t as *mut fep_tensor })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The cases
// ---------------------------------------------------------------------------------------------

fn cases() -> Vec<Case> {
    let mut c = Vec::new();
    config_cases(&mut c);
    create_cases(&mut c);
    boot_cases(&mut c);
    layout_and_plan_cases(&mut c);
    dispatch_cases(&mut c);
    combine_cases(&mut c);
    ll_cases(&mut c);
    deepep_ll_cases(&mut c);
    lifetime_cases(&mut c);
    gpu_cases(&mut c);
    ep_cases(&mut c);
    misc_cases(&mut c);
    c
}

type Edit = fn(&mut fep_config);

const CONFIG_EDITS: &[(&str, &[&str], Edit)] = &[
    ("timeout_nan", &["timeout_s"], |c| c.timeout_s = f64::NAN),
    ("timeout_neg", &["timeout_s"], |c| c.timeout_s = -1.0),
    ("timeout_inf", &["timeout_s"], |c| c.timeout_s = f64::INFINITY),
    ("timeout_neg_inf", &["timeout_s"], |c| c.timeout_s = f64::NEG_INFINITY),
    ("timeout_1e300", &["timeout_s"], |c| c.timeout_s = 1e300),
    ("num_sms_neg", &["num_sms"], |c| c.num_sms = -2),
    ("chunk_tokens_neg", &["chunk_tokens"], |c| c.chunk_tokens = -1),
    ("slots_per_peer_neg", &["slots_per_peer"], |c| c.slots_per_peer = -3),
    ("max_tokens_neg", &["max_tokens_per_rank"], |c| c.max_tokens_per_rank = -1),
    ("ranks_per_node_neg", &["ranks_per_node"], |c| c.ranks_per_node = -1),
    ("ranks_per_node_big", &["ranks_per_node"], |c| c.ranks_per_node = 3),
    ("local_rank_neg", &["local_rank"], |c| c.local_rank = -5),
    ("local_rank_big", &["local_rank"], |c| c.local_rank = 4),
    ("rank_neg", &["rank"], |c| c.rank = -7),
    ("rank_big", &["rank"], |c| c.rank = 1),
    ("rank_min", &["rank"], |c| c.rank = i32::MIN),
    ("num_ranks_neg", &["num_ranks"], |c| c.num_ranks = -2),
    ("num_ranks_zero", &["num_ranks"], |c| c.num_ranks = 0),
    ("device_neg", &["device"], |c| c.device = -2),
    ("gpu_reserve_neg", &["gpu_reserve_tokens"], |c| c.gpu_reserve_tokens = -2),
    ("hier_2", &["internode_hierarchy"], |c| c.internode_hierarchy = 2),
    ("hier_host", &["internode_hierarchy"], |c| c.internode_hierarchy = 1),
    ("modes_4", &["modes"], |c| c.modes = 4),
    ("modes_neg", &["modes"], |c| c.modes = -1),
    ("num_experts_zero", &["num_experts"], |c| c.num_experts = 0),
    ("num_experts_neg", &["num_experts"], |c| c.num_experts = -8),
    ("hidden_neg", &["hidden"], |c| c.hidden = -256),
    ("hidden_zero", &["hidden"], |c| c.hidden = 0),
    ("hidden_odd_fp8", &["hidden"], |c| {
        c.hidden = 200;
        c.dispatch_dtype = FEP_DTYPE_FP8_E4M3
    }),
    ("num_topk_big", &["num_topk"], |c| c.num_topk = 9),
    ("num_topk_zero", &["num_topk"], |c| c.num_topk = 0),
    ("dispatch_dtype_7", &["dispatch_dtype"], |c| c.dispatch_dtype = 7),
    ("dispatch_dtype_f32", &["dispatch_dtype"], |c| c.dispatch_dtype = FEP_DTYPE_F32),
    ("backend_5", &["backend"], |c| c.backend = 5),
    ("backend_neg", &["backend"], |c| c.backend = -1),
    ("struct_size_81", &["cfg"], |c| c.struct_size = 81),
    ("struct_size_4096", &["cfg"], |c| c.struct_size = 4096),
    ("struct_size_8", &["cfg"], |c| c.struct_size = 8),
    ("struct_size_0", &["cfg"], |c| c.struct_size = 0),
    ("struct_size_76", &["cfg"], |c| c.struct_size = FEP_CONFIG_V1_SIZE - 4),
    ("struct_size_max", &["cfg"], |c| c.struct_size = u32::MAX),
    ("version_99", &["cfg"], |c| c.version = 99),
    ("version_0", &["cfg"], |c| c.version = 0),
    ("enable_shrink_2", &["enable_shrink"], |c| c.enable_shrink = 2),
    ("enable_shrink_neg", &["enable_shrink"], |c| c.enable_shrink = -1),
    // The GPU backend's shrink mode needs every rank on one node.
    ("enable_shrink_gpu_nodes", &["enable_shrink"], |c| {
        c.enable_shrink = 1;
        c.backend = FEP_BACKEND_GPU;
        c.num_ranks = 2;
        c.ranks_per_node = 1;
    }),
];

/// Sizes that would allocate without bound: a clean refusal, or a buffer when the machine has
/// the memory; never an abort.
const CONFIG_HUGE: &[(&str, &[&str], Edit)] = &[
    ("hidden_max", &["hidden"], |c| c.hidden = i32::MAX - 127),
    ("num_experts_max", &["num_experts"], |c| c.num_experts = i32::MAX),
    ("num_topk_max", &["num_topk"], |c| c.num_topk = i32::MAX),
    ("max_tokens_max", &["max_tokens_per_rank"], |c| c.max_tokens_per_rank = i32::MAX),
    ("chunk_tokens_max", &["chunk_tokens"], |c| c.chunk_tokens = i32::MAX),
    ("slots_per_peer_max", &["slots_per_peer"], |c| c.slots_per_peer = i32::MAX),
    ("num_sms_max", &["num_sms"], |c| c.num_sms = i32::MAX),
];

fn config_cases(c: &mut Vec<Case>) {
    for &(name, args, edit) in CONFIG_EDITS {
        case(c, format!("fep_buffer_create/{name}"), Want::Refuse(args), move || {
            let mut cfg = config();
            edit(&mut cfg);
            let (st, b) = create(&cfg);
            if !b.is_null() && st != FEP_OK {
                return Got { st: FEP_ERR_INTERNAL as i32, msg: "an error with a buffer".into() };
            }
            got(st)
        });
        case(c, format!("fep_get_size_hints/{name}"), Want::Refuse(args), move || {
            let mut cfg = config();
            edit(&mut cfg);
            let mut h = fep_size_hints::default();
            got(unsafe { fep_get_size_hints(&cfg, &mut h) })
        });
    }
    for &(name, args, edit) in CONFIG_HUGE {
        case(c, format!("fep_buffer_create/{name}"), Want::Bounded(args), move || {
            let mut cfg = config();
            edit(&mut cfg);
            got(create(&cfg).0)
        });
        case(c, format!("fep_get_size_hints/{name}"), Want::Bounded(args), move || {
            let mut cfg = config();
            edit(&mut cfg);
            let mut h = fep_size_hints::default();
            got(unsafe { fep_get_size_hints(&cfg, &mut h) })
        });
    }
    case(c, "fep_get_size_hints/cfg_null", Want::Refuse(&["cfg"]), || {
        let mut h = fep_size_hints::default();
        got(unsafe { fep_get_size_hints(null(), &mut h) })
    });
    case(c, "fep_get_size_hints/out_null", Want::Refuse(&["out"]), || {
        got(unsafe { fep_get_size_hints(&config(), null_mut()) })
    });
    case(c, "fep_get_size_hints/valid", Want::Accept, || {
        let mut h = fep_size_hints::default();
        let st = unsafe { fep_get_size_hints(&config(), &mut h) };
        if st == FEP_OK && (h.normal_bytes == 0 || h.ll_bytes == 0) {
            return Got { st: FEP_ERR_INTERNAL as i32, msg: format!("empty hints {h:?}") };
        }
        got(st)
    });
    case(c, "fep_get_size_hints/v1_struct", Want::Accept, || {
        // A caller built against the first header: 80 bytes, the rest is not its memory.
        let mut cfg = config();
        cfg.struct_size = FEP_CONFIG_V1_SIZE;
        cfg.device = i32::MIN;
        cfg.modes = 77;
        let mut h = fep_size_hints::default();
        got(unsafe { fep_get_size_hints(&cfg, &mut h) })
    });
    case(c, "fep_config_init/null", Want::Refuse(&["cfg"]), || {
        got(unsafe { fep_config_init(null_mut()) })
    });
}

fn provider_case(c: &mut Vec<Case>, name: &str, want: Want, bytes: Vec<u8>) {
    case(c, format!("fep_buffer_create/provider_{name}"), want, move || {
        let s = CString::new(bytes.clone()).unwrap();
        let mut cfg = config();
        cfg.provider = s.as_ptr();
        let (st, b) = create(&cfg);
        if st == FEP_OK {
            unsafe { fep_buffer_destroy(b) };
        }
        Got { st: st as i32, msg: last_error() }
    });
}

fn create_cases(c: &mut Vec<Case>) {
    case(c, "fep_buffer_create/out_null", Want::Refuse(&["out"]), || {
        got(unsafe { fep_buffer_create(&config(), Some(copy_gather), null_mut(), null_mut()) })
    });
    case(c, "fep_buffer_create/cfg_null", Want::Refuse(&["cfg"]), || {
        let mut b = null_mut();
        got(unsafe { fep_buffer_create(null(), Some(copy_gather), null_mut(), &mut b) })
    });
    case(
        c,
        "fep_buffer_create/allgather_fails",
        Want::Fail(FEP_ERR_BOOTSTRAP, &["all-gather"]),
        || {
            let mut b = null_mut();
            got(unsafe { fep_buffer_create(&config(), Some(failing_gather), null_mut(), &mut b) })
        },
    );
    case(c, "fep_buffer_create/valid", Want::Accept, || {
        let (st, b) = create(&config());
        if st == FEP_OK {
            return got(unsafe { fep_buffer_destroy(b) });
        }
        got(st)
    });
    provider_case(c, "empty", Want::Refuse(&["provider"]), b"".to_vec());
    provider_case(c, "blank", Want::Refuse(&["provider"]), b"  \t".to_vec());
    provider_case(c, "non_utf8", Want::Refuse(&["provider"]), vec![0xff, 0xfe, b's']);
    provider_case(c, "oversized", Want::Refuse(&["provider"]), vec![b's'; 1 << 20]);
    provider_case(
        c,
        "unknown",
        Want::Fail(FEP_ERR_FABRIC, &["provider"]),
        b"nosuchprovider".to_vec(),
    );
    provider_case(c, "shm", Want::Accept, b"shm".to_vec());
    // Over a bootstrap object.
    case(c, "fep_buffer_create_boot/boot_null", Want::Refuse(&["boot"]), || {
        let mut b = null_mut();
        got(unsafe { fep_buffer_create_boot(&config(), null(), &mut b) })
    });
    case(c, "fep_buffer_create_boot/boot_foreign", Want::Refuse(&["boot"]), || {
        let mut b = null_mut();
        got(unsafe { fep_buffer_create_boot(&config(), 0x4000usize as *const fep_boot, &mut b) })
    });
    case(c, "fep_buffer_create_boot/boot_destroyed", Want::Refuse(&["boot"]), || {
        let boot = real_boot();
        setup(unsafe { fep_boot_destroy(boot) }, "fep_boot_destroy");
        let mut b = null_mut();
        got(unsafe { fep_buffer_create_boot(&config(), boot, &mut b) })
    });
    case(c, "fep_buffer_create_boot/cfg_null", Want::Refuse(&["cfg"]), || {
        let boot = real_boot();
        let mut b = null_mut();
        got(unsafe { fep_buffer_create_boot(null(), boot, &mut b) })
    });
    case(c, "fep_buffer_create_boot/out_null", Want::Refuse(&["out"]), || {
        let boot = real_boot();
        got(unsafe { fep_buffer_create_boot(&config(), boot, null_mut()) })
    });
    case(c, "fep_buffer_create_boot/rank_disagrees", Want::Refuse(&["rank", "cfg"]), || {
        let boot = real_boot();
        let mut cfg = config();
        cfg.rank = 1;
        cfg.num_ranks = 2;
        cfg.ranks_per_node = 2;
        let mut b = null_mut();
        got(unsafe { fep_buffer_create_boot(&cfg, boot, &mut b) })
    });
    case(c, "fep_buffer_create_boot/valid", Want::Accept, || {
        let boot = real_boot();
        let mut cfg = config();
        (cfg.rank, cfg.num_ranks, cfg.local_rank, cfg.ranks_per_node) = (-1, -1, -1, 0);
        let mut b = null_mut();
        let st = unsafe { fep_buffer_create_boot(&cfg, boot, &mut b) };
        if st == FEP_OK {
            setup(unsafe { fep_buffer_destroy(b) }, "fep_buffer_destroy");
            return got(unsafe { fep_boot_destroy(boot) });
        }
        got(st)
    });
}

/// Points this process at a world-1 store on a free local port.
fn boot_env() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    for (k, v) in [
        ("RANK", "0".to_string()),
        ("WORLD_SIZE", "1".into()),
        ("LOCAL_RANK", "0".into()),
        ("LOCAL_WORLD_SIZE", "1".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("FEP_MASTER_PORT", port.to_string()),
        ("FEP_JOB_ID", format!("bad-input-{}", std::process::id())),
    ] {
        std::env::set_var(k, v);
    }
}

fn real_boot() -> *mut fep_boot {
    boot_env();
    let mut b = null_mut();
    setup(unsafe { fep_boot_create(10.0, &mut b) }, "fep_boot_create");
    b
}

fn boot_cases(c: &mut Vec<Case>) {
    for (name, t) in [
        ("nan", f64::NAN),
        ("inf", f64::INFINITY),
        ("neg", -1.0),
        ("neg_inf", f64::NEG_INFINITY),
        ("1e300", 1e300),
    ] {
        case(
            c,
            format!("fep_boot_create/timeout_{name}"),
            Want::Refuse(&["timeout_s"]),
            move || {
                boot_env();
                let mut b = null_mut();
                got(unsafe { fep_boot_create(t, &mut b) })
            },
        );
    }
    case(c, "fep_boot_create/out_null", Want::Refuse(&["out"]), || {
        boot_env();
        got(unsafe { fep_boot_create(1.0, null_mut()) })
    });
    case(
        c,
        "fep_boot_create/no_env",
        Want::Fail(FEP_ERR_BOOTSTRAP, &["MASTER_ADDR", "RANK", "WORLD_SIZE"]),
        || {
            for k in [
                "RANK",
                "WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "FEP_MASTER_PORT",
                "LOCAL_RANK",
            ] {
                std::env::remove_var(k);
            }
            let mut b = null_mut();
            got(unsafe { fep_boot_create(1.0, &mut b) })
        },
    );
    case(
        c,
        "fep_boot_create/bad_port",
        Want::Fail(FEP_ERR_BOOTSTRAP, &["FEP_MASTER_PORT"]),
        || {
            boot_env();
            std::env::set_var("FEP_MASTER_PORT", "99999999");
            let mut b = null_mut();
            got(unsafe { fep_boot_create(1.0, &mut b) })
        },
    );
    case(c, "fep_boot_create/valid", Want::Accept, || {
        boot_env();
        let mut b = null_mut();
        let st = unsafe { fep_boot_create(10.0, &mut b) };
        if st == FEP_OK {
            return got(unsafe { fep_boot_destroy(b) });
        }
        got(st)
    });
    case(c, "fep_boot_rank/null", Want::Refuse(&["boot"]), || {
        let mut r = 0;
        got(unsafe { fep_boot_rank(null(), &mut r, null_mut(), null_mut(), null_mut()) })
    });
    case(c, "fep_boot_rank/foreign", Want::Refuse(&["boot"]), || {
        let mut r = 0;
        got(unsafe {
            fep_boot_rank(
                0x3000usize as *const fep_boot,
                &mut r,
                null_mut(),
                null_mut(),
                null_mut(),
            )
        })
    });
    case(c, "fep_boot_rank/destroyed", Want::Refuse(&["boot"]), || {
        let b = real_boot();
        setup(unsafe { fep_boot_destroy(b) }, "fep_boot_destroy");
        let mut r = 0;
        got(unsafe { fep_boot_rank(b, &mut r, null_mut(), null_mut(), null_mut()) })
    });
    case(c, "fep_boot_rank/outputs_null", Want::Accept, || {
        let b = real_boot();
        got(unsafe { fep_boot_rank(b, null_mut(), null_mut(), null_mut(), null_mut()) })
    });
    case(c, "fep_boot_destroy/twice", Want::Refuse(&["boot"]), || {
        let b = real_boot();
        setup(unsafe { fep_boot_destroy(b) }, "fep_boot_destroy");
        got(unsafe { fep_boot_destroy(b) })
    });
    case(c, "fep_boot_destroy/foreign", Want::Refuse(&["boot"]), || {
        got(unsafe { fep_boot_destroy(0x3000usize as *mut fep_boot) })
    });
    case(c, "fep_boot_destroy/null", Want::Accept, || got(unsafe { fep_boot_destroy(null_mut()) }));
    let gather = |send: bool, len: usize, recv: bool, user: u8| {
        move || {
            let src = [7u8; 16];
            let mut dst = [0u8; 16];
            let u: *mut c_void = match user {
                0 => real_boot().cast(),
                1 => null_mut(),
                2 => 0x5000usize as *mut c_void,
                _ => {
                    let b = real_boot();
                    setup(unsafe { fep_boot_destroy(b) }, "fep_boot_destroy");
                    b.cast()
                }
            };
            let s = if send { src.as_ptr().cast() } else { null() };
            let r = if recv { dst.as_mut_ptr().cast() } else { null_mut() };
            let st = unsafe { fep_boot_allgather(s, len, r, u) };
            if st == 0 && len > 0 && dst[..len] != src[..len] {
                return Got { st: FEP_ERR_INTERNAL as i32, msg: "wrong bytes".into() };
            }
            Got { st, msg: last_error() }
        }
    };
    case(c, "fep_boot_allgather/user_null", Want::Refuse(&["user"]), gather(true, 8, true, 1));
    case(c, "fep_boot_allgather/user_foreign", Want::Refuse(&["user"]), gather(true, 8, true, 2));
    case(c, "fep_boot_allgather/user_destroyed", Want::Refuse(&["user"]), gather(true, 8, true, 3));
    case(c, "fep_boot_allgather/send_null", Want::Refuse(&["send"]), gather(false, 8, true, 0));
    case(c, "fep_boot_allgather/recv_null", Want::Refuse(&["recv"]), gather(true, 8, false, 0));
    case(
        c,
        "fep_boot_allgather/len_overflow",
        Want::Refuse(&["len"]),
        gather(true, usize::MAX, true, 0),
    );
    case(c, "fep_boot_allgather/len_huge", Want::Refuse(&["len"]), gather(true, 1 << 62, true, 0));
    case(c, "fep_boot_allgather/len_zero", Want::Accept, gather(false, 0, false, 0));
    case(c, "fep_boot_allgather/valid", Want::Accept, gather(true, 16, true, 0));
}

#[allow(clippy::type_complexity)]
fn layout_and_plan_cases(c: &mut Vec<Case>) {
    // fep_get_dispatch_layout_host over 4 tokens, top-2, 8 experts, 2 ranks of 1 node.
    #[derive(Clone, Copy)]
    struct L {
        nt: i64,
        k: i32,
        e: i32,
        r: i32,
        rpn: i32,
        idx: Option<[i64; 8]>,
        null_idx: bool,
        null_out: u8,
    }
    let base = L { nt: 4, k: 2, e: 8, r: 2, rpn: 2, idx: None, null_idx: false, null_out: 0 };
    let run = move |l: L| {
        move || {
            let v = l.idx.unwrap_or([0, 1, 2, 3, 4, 5, 6, 7]);
            let mut per_rank = [0i32; 64];
            let mut per_node = [0i32; 64];
            let mut per_expert = [0i32; 64];
            let mut in_rank = [false; 64];
            let o = |i: u8, p: *mut i32| if l.null_out == i { null_mut() } else { p };
            let st = unsafe {
                fep_get_dispatch_layout_host(
                    if l.null_idx { null() } else { v.as_ptr() },
                    l.nt,
                    l.k,
                    l.e,
                    l.r,
                    l.rpn,
                    o(1, per_rank.as_mut_ptr()),
                    o(2, per_node.as_mut_ptr()),
                    o(3, per_expert.as_mut_ptr()),
                    if l.null_out == 4 { null_mut() } else { in_rank.as_mut_ptr() },
                )
            };
            // Tokens 0, 1 go to rank 0's experts 0..4, tokens 2, 3 to rank 1's.
            if st == FEP_OK
                && l.null_out == 0
                && l.nt == 4
                && l.idx.is_none()
                && per_rank[..2] != [2, 2]
            {
                return Got {
                    st: FEP_ERR_INTERNAL as i32,
                    msg: format!("per rank {:?}", &per_rank[..2]),
                };
            }
            got(st)
        }
    };
    let cases: &[(&str, Want, fn(&mut L))] = &[
        ("valid", Want::Accept, |_| {}),
        ("zero_tokens", Want::Accept, |l| l.nt = 0),
        ("zero_tokens_null_idx", Want::Accept, |l| (l.nt, l.null_idx) = (0, true)),
        ("all_minus_one", Want::Accept, |l| l.idx = Some([-1; 8])),
        ("per_node_null", Want::Accept, |l| l.null_out = 2),
        ("idx_null", Want::Refuse(&["topk_idx"]), |l| l.null_idx = true),
        ("num_tokens_neg", Want::Refuse(&["num_tokens"]), |l| l.nt = -1),
        ("num_tokens_min", Want::Refuse(&["num_tokens"]), |l| l.nt = i64::MIN),
        ("num_tokens_overflow", Want::Refuse(&["num_tokens"]), |l| l.nt = i64::MAX),
        ("num_tokens_2e40", Want::Refuse(&["num_tokens"]), |l| l.nt = 1 << 40),
        ("num_topk_neg", Want::Refuse(&["num_topk"]), |l| l.k = -2),
        ("num_topk_zero", Want::Refuse(&["num_topk"]), |l| l.k = 0),
        ("num_experts_zero", Want::Refuse(&["num_experts"]), |l| l.e = 0),
        ("num_experts_neg", Want::Refuse(&["num_experts"]), |l| l.e = -8),
        ("num_experts_indivisible", Want::Refuse(&["num_experts", "num_ranks"]), |l| l.r = 3),
        ("num_ranks_zero", Want::Refuse(&["num_ranks"]), |l| l.r = 0),
        ("num_ranks_neg", Want::Refuse(&["num_ranks"]), |l| l.r = -2),
        ("ranks_per_node_zero", Want::Refuse(&["ranks_per_node"]), |l| l.rpn = 0),
        ("ranks_per_node_neg", Want::Refuse(&["ranks_per_node"]), |l| l.rpn = -1),
        ("ranks_per_node_indivisible", Want::Refuse(&["ranks_per_node"]), |l| {
            (l.e, l.r, l.rpn) = (8, 4, 3)
        }),
        ("idx_too_big", Want::Refuse(&["topk_idx"]), |l| l.idx = Some([0, 1, 2, 8, 4, 5, 6, 7])),
        ("idx_too_small", Want::Refuse(&["topk_idx"]), |l| l.idx = Some([0, 1, 2, -2, 4, 5, 6, 7])),
        ("idx_min", Want::Refuse(&["topk_idx"]), |l| l.idx = Some([i64::MIN, 1, 2, 3, 4, 5, 6, 7])),
        ("per_rank_null", Want::Refuse(&["num_tokens_per_rank"]), |l| l.null_out = 1),
        ("per_expert_null", Want::Refuse(&["num_tokens_per_expert"]), |l| l.null_out = 3),
        ("in_rank_null", Want::Refuse(&["is_token_in_rank"]), |l| l.null_out = 4),
    ];
    for &(name, want, edit) in cases {
        let mut l = base;
        edit(&mut l);
        case(c, format!("fep_get_dispatch_layout_host/{name}"), want, run(l));
    }
    // fep_gpu_layout_*: the arguments are checked before any GPU is touched, so a machine
    // without one refuses them exactly as one with one does.
    let create = |d: i32, e: i32, r: i32, rpn: i32, null_out: bool| {
        move || {
            let mut l: *mut fep_gpu_layout = null_mut();
            let out = if null_out { null_mut() } else { &mut l as *mut _ };
            got(unsafe { fep_gpu_layout_create(d, e, r, rpn, out) })
        }
    };
    let lcases: &[(&str, Want, [i32; 4], bool)] = &[
        ("device_negative", Want::Refuse(&["device"]), [-1, 64, 8, 8], false),
        ("experts_zero", Want::Refuse(&["num_experts"]), [0, 0, 8, 8], false),
        ("experts_negative", Want::Refuse(&["num_experts"]), [0, -64, 8, 8], false),
        ("experts_not_multiple", Want::Refuse(&["num_experts"]), [0, 65, 8, 8], false),
        ("ranks_zero", Want::Refuse(&["num_ranks"]), [0, 64, 0, 1], false),
        ("rpn_zero", Want::Refuse(&["ranks_per_node"]), [0, 64, 8, 0], false),
        ("rpn_not_dividing", Want::Refuse(&["ranks_per_node"]), [0, 64, 8, 3], false),
        ("out_null", Want::Refuse(&["out"]), [0, 64, 8, 8], true),
    ];
    for &(name, want, [d, e, r, rpn], null_out) in lcases {
        case(c, format!("fep_gpu_layout_create/{name}"), want, create(d, e, r, rpn, null_out));
    }
    let foreign = 0x1000usize as *mut fep_gpu_layout;
    for (name, l) in [("null", null_mut()), ("never_created", foreign)] {
        let l = l as usize;
        case(
            c,
            format!("fep_gpu_layout_run/layout_{name}"),
            Want::Refuse(&["layout"]),
            move || {
                let o = fep_gpu_order {
                    stream: null_mut(),
                    wait_stream: null_mut(),
                    wait_event: null_mut(),
                    then_stream: null_mut(),
                };
                let l = l as *mut fep_gpu_layout;
                got(unsafe { fep_gpu_layout_run(l, null(), null(), null(), null(), null(), &o) })
            },
        );
        case(
            c,
            format!("fep_gpu_layout_destroy/layout_{name}"),
            Want::Refuse(&["layout"]),
            move || got(unsafe { fep_gpu_layout_destroy(l as *mut fep_gpu_layout) }),
        );
    }
    // fep_plan_table.
    let plan = |a: [i64; 5], fp8: bool, buf: u8, len: usize| {
        move || {
            let mut out = vec![0 as c_char; 1 << 16];
            let mut needed = 0usize;
            let p = match buf {
                0 => out.as_mut_ptr(),
                _ => null_mut(),
            };
            let st =
                unsafe { fep_plan_table(a[0], a[1], a[2], a[3], fp8, a[4], p, len, &mut needed) };
            if st == FEP_OK && needed == 0 {
                return Got { st: FEP_ERR_INTERNAL as i32, msg: "needed not written".into() };
            }
            got(st)
        }
    };
    let ok = [8, 64, 2048, 4, 128];
    let plans: &[(&str, Want, [i64; 5], u8, usize)] = &[
        ("valid", Want::Accept, ok, 0, 1 << 16),
        ("len_zero_null", Want::Accept, ok, 1, 0),
        ("truncated", Want::Accept, ok, 0, 5),
        ("zero_tokens", Want::Accept, [8, 64, 2048, 4, 0], 0, 1 << 16),
        ("buf_null", Want::Refuse(&["buf"]), ok, 1, 64),
        ("num_ranks_neg", Want::Refuse(&["num_ranks"]), [-8, 64, 2048, 4, 128], 0, 1 << 16),
        ("num_ranks_zero", Want::Refuse(&["num_ranks"]), [0, 64, 2048, 4, 128], 0, 1 << 16),
        (
            "num_ranks_huge",
            Want::Refuse(&["num_ranks"]),
            [1 << 40, 1 << 41, 2048, 4, 128],
            0,
            1 << 16,
        ),
        ("num_experts_neg", Want::Refuse(&["num_experts"]), [8, -64, 2048, 4, 128], 0, 1 << 16),
        (
            "num_experts_indivisible",
            Want::Refuse(&["num_experts", "num_ranks"]),
            [8, 63, 2048, 4, 128],
            0,
            1 << 16,
        ),
        ("hidden_neg", Want::Refuse(&["hidden"]), [8, 64, -1, 4, 128], 0, 1 << 16),
        ("hidden_max", Want::Refuse(&["hidden"]), [8, 64, i64::MAX, 4, 128], 0, 1 << 16),
        ("num_topk_neg", Want::Refuse(&["num_topk"]), [8, 64, 2048, -4, 128], 0, 1 << 16),
        ("num_topk_big", Want::Refuse(&["num_topk"]), [8, 64, 2048, 65, 128], 0, 1 << 16),
        ("num_tokens_neg", Want::Refuse(&["num_tokens"]), [8, 64, 2048, 4, -128], 0, 1 << 16),
        ("num_tokens_max", Want::Refuse(&["num_tokens"]), [8, 64, 2048, 4, i64::MAX], 0, 1 << 16),
    ];
    for &(name, want, a, buf, len) in plans {
        case(c, format!("fep_plan_table/{name}"), want, plan(a, false, buf, len));
    }
    case(
        c,
        "fep_plan_table/fp8_hidden_odd",
        Want::Refuse(&["hidden"]),
        plan([8, 64, 200, 4, 128], true, 0, 1 << 16),
    );
}

fn dispatch_call(
    b: *mut fep_buffer,
    t: &[*mut fep_tensor],
    cached: *const fep_handle,
    align: i32,
    worst: i64,
) -> Got {
    let (mut h, mut rows) = (null_mut(), 0i64);
    let st = unsafe {
        fep_dispatch(b, t[0], t[1], t[2], t[3], cached, align, worst, null_mut(), &mut h, &mut rows)
    };
    if st == FEP_OK && h.is_null() {
        return Got { st: FEP_ERR_INTERNAL as i32, msg: "OK without a handle".into() };
    }
    got(st)
}

fn dispatch_cases(c: &mut Vec<Case>) {
    const BF16: &[(&str, i32, bool)] = &[
        ("x", FEP_DTYPE_BF16, false),
        ("topk_idx", FEP_DTYPE_I64, false),
        ("topk_weights", FEP_DTYPE_F32, false),
    ];
    tensor_matrix(c, "fep_dispatch", BF16, |i, m| {
        let b = buffer();
        let mut ts = vec![x_bf16(4), idx(4), weights(4)];
        let p = ptrs(&mut ts, i, m);
        dispatch_call(b, &[p[0], null_mut(), p[1], p[2]], null(), 1, 0)
    });
    const FP8: &[(&str, i32, bool)] = &[("x_scales", FEP_DTYPE_F32, false)];
    tensor_matrix(c, "fep_dispatch_fp8", FP8, |i, m| {
        let b = fp8_buffer();
        let (x, s) = x_fp8(4);
        let mut ts = vec![s];
        let p = ptrs(&mut ts, i, m);
        let (mut xi, mut wi, mut x) = (idx(4), weights(4), x);
        dispatch_call(b, &[&mut x.t, p[0], &mut xi.t, &mut wi.t], null(), 1, 0)
    });
    // Scalars, routing values and lifetimes.
    type D = fn(*mut fep_buffer) -> Got;
    let ds: &[(&str, Want, D)] = &[
        ("valid", Want::Accept, |b| {
            let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights(4));
            dispatch_call(b, &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 0)
        }),
        ("zero_tokens", Want::Accept, |b| {
            let (mut x, mut i, mut w) = (x_bf16(0), idx(0), weights(0));
            dispatch_call(b, &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 0)
        }),
        ("one_token", Want::Accept, |b| {
            let (mut x, mut i, mut w) = (x_bf16(1), idx(1), weights(1));
            dispatch_call(b, &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 0)
        }),
        ("all_minus_one", Want::Accept, |b| {
            let (mut x, mut i, mut w) = (x_bf16(4), idx_of(4, &[-1; 8]), weights(4));
            dispatch_call(b, &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 0)
        }),
        // Normal mode counts a token once per rank: an expert named twice is DeepEP's (valid).
        ("duplicate_expert", Want::Accept, |b| {
            let (mut x, mut i, mut w) =
                (x_bf16(4), idx_of(4, &[1, 1, 2, 3, 4, 5, 6, 7]), weights(4));
            dispatch_call(b, &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 0)
        }),
        ("fp8_valid", Want::Accept, |_| {
            let b = fp8_buffer();
            let ((mut x, mut s), mut i, mut w) = (x_fp8(4), idx(4), weights(4));
            dispatch_call(b, &[&mut x.t, &mut s.t, &mut i.t, &mut w.t], null(), 1, 0)
        }),
        ("worst_tokens_valid", Want::Accept, |b| {
            let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights(4));
            dispatch_call(b, &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 64)
        }),
        ("alignment_valid", Want::Accept, |b| {
            let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights(4));
            dispatch_call(b, &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 128, 0)
        }),
    ];
    for &(name, want, f) in ds {
        case(c, format!("fep_dispatch/{name}"), want, move || f(buffer()));
    }
    let idx_bad: &[(&str, [i64; 8])] = &[
        ("idx_eq_experts", [0, 1, 2, 8, 4, 5, 6, 7]),
        ("idx_big", [0, 1, 2, 1000, 4, 5, 6, 7]),
        ("idx_minus_two", [0, 1, -2, 3, 4, 5, 6, 7]),
        ("idx_min", [i64::MIN, 1, 2, 3, 4, 5, 6, 7]),
        ("idx_max", [0, 1, 2, 3, 4, 5, 6, i64::MAX]),
        ("idx_2e32", [0, 1, 2, 3, 1 << 32, 5, 6, 7]),
    ];
    for &(name, v) in idx_bad {
        case(c, format!("fep_dispatch/{name}"), Want::Refuse(&["topk_idx"]), move || {
            let (mut x, mut i, mut w) = (x_bf16(4), idx_of(4, &v), weights(4));
            dispatch_call(buffer(), &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 0)
        });
    }
    for (name, v) in [("nan", f32::NAN), ("inf", f32::INFINITY), ("neg_inf", f32::NEG_INFINITY)] {
        case(
            c,
            format!("fep_dispatch/weights_{name}"),
            Want::Refuse(&["topk_weights"]),
            move || {
                let mut wv = [0.5f32; 8];
                wv[5] = v;
                let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights_of(4, &wv));
                dispatch_call(buffer(), &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 0)
            },
        );
        case(c, format!("fep_dispatch/scales_{name}"), Want::Refuse(&["x_scales"]), move || {
            let (mut x, _) = x_fp8(4);
            let mut sv = [0.5f32; 8];
            sv[3] = v;
            let mut s = ten_of(FEP_DTYPE_F32, &[4, 2], &sv);
            let (mut i, mut w) = (idx(4), weights(4));
            dispatch_call(fp8_buffer(), &[&mut x.t, &mut s.t, &mut i.t, &mut w.t], null(), 1, 0)
        });
    }
    for (name, a) in [("zero", 0), ("neg", -1), ("min", i32::MIN)] {
        case(
            c,
            format!("fep_dispatch/alignment_{name}"),
            Want::Refuse(&["expert_alignment"]),
            move || {
                let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights(4));
                dispatch_call(buffer(), &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), a, 0)
            },
        );
    }
    for (name, n) in [
        ("neg", -1),
        ("min", i64::MIN),
        ("max", i64::MAX),
        ("2e40", 1 << 40),
        ("2e31", 1 << 31),
        ("too_few", 3),
    ] {
        case(
            c,
            format!("fep_dispatch/worst_tokens_{name}"),
            Want::Refuse(&["num_worst_tokens"]),
            move || {
                let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights(4));
                dispatch_call(buffer(), &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, n)
            },
        );
    }
    // The 2^31 - 1 rows DeepEP's int allows: refused when the host cannot hold the outputs.
    case(c, "fep_dispatch/worst_tokens_i32_max", Want::Bounded(&["num_worst_tokens"]), || {
        let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights(4));
        dispatch_call(
            buffer(),
            &[&mut x.t, null_mut(), &mut i.t, &mut w.t],
            null(),
            1,
            i32::MAX as i64,
        )
    });
    case(c, "fep_dispatch/x_dtype_fp8_no_scales", Want::Refuse(&["x_scales"]), || {
        let ((mut x, _), mut i, mut w) = (x_fp8(4), idx(4), weights(4));
        dispatch_call(buffer(), &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 0)
    });
    case(c, "fep_dispatch/scales_with_bf16", Want::Refuse(&["x_scales"]), || {
        let ((_, mut s), mut x, mut i, mut w) = (x_fp8(4), x_bf16(4), idx(4), weights(4));
        dispatch_call(buffer(), &[&mut x.t, &mut s.t, &mut i.t, &mut w.t], null(), 1, 0)
    });
    case(c, "fep_dispatch/tokens_i32_overflow", Want::Refuse(&["x"]), || {
        let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights(4));
        (x.t.shape[0], i.t.shape[0], w.t.shape[0]) = (1 << 32, 1 << 32, 1 << 32);
        dispatch_call(buffer(), &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 0)
    });
    case(c, "fep_dispatch/buf_null", Want::Refuse(&["buf"]), || {
        let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights(4));
        dispatch_call(null_mut(), &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 0)
    });
    case(c, "fep_dispatch/buf_foreign", Want::Refuse(&["buf"]), || {
        let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights(4));
        dispatch_call(
            0x7000usize as *mut fep_buffer,
            &[&mut x.t, null_mut(), &mut i.t, &mut w.t],
            null(),
            1,
            0,
        )
    });
    case(c, "fep_dispatch/buf_destroyed", Want::Refuse(&["buf"]), || {
        let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights(4));
        dispatch_call(destroyed_buffer(), &[&mut x.t, null_mut(), &mut i.t, &mut w.t], null(), 1, 0)
    });
    case(c, "fep_dispatch/out_handle_null", Want::Refuse(&["out_handle"]), || {
        let (x, i, w) = (x_bf16(4), idx(4), weights(4));
        let mut rows = 0;
        got(unsafe {
            fep_dispatch(
                buffer(),
                &x.t,
                null(),
                &i.t,
                &w.t,
                null(),
                1,
                0,
                null_mut(),
                null_mut(),
                &mut rows,
            )
        })
    });
    case(c, "fep_dispatch/num_recv_null", Want::Accept, || {
        let (x, i, w) = (x_bf16(4), idx(4), weights(4));
        let mut h = null_mut();
        got(unsafe {
            fep_dispatch(
                buffer(),
                &x.t,
                null(),
                &i.t,
                &w.t,
                null(),
                1,
                0,
                null_mut(),
                &mut h,
                null_mut(),
            )
        })
    });
    case(c, "fep_dispatch/stream_given", Want::Refuse(&["stream"]), || {
        let (x, i, w) = (x_bf16(4), idx(4), weights(4));
        let (mut h, mut rows) = (null_mut(), 0);
        got(unsafe {
            fep_dispatch(
                buffer(),
                &x.t,
                null(),
                &i.t,
                &w.t,
                null(),
                1,
                0,
                0x10usize as *mut c_void,
                &mut h,
                &mut rows,
            )
        })
    });
    // Cached dispatches.
    let cached = |which: u8| {
        move || {
            let b = buffer();
            let (h, _) = dispatched(b, 4, false);
            let (mut x, mut i, mut w) = (x_bf16(4), idx(4), weights(4));
            match which {
                0 => dispatch_call(b, &[&mut x.t, null_mut(), null_mut(), null_mut()], h, 1, 0),
                1 => dispatch_call(b, &[&mut x.t, null_mut(), &mut i.t, &mut w.t], h, 1, 0),
                2 => dispatch_call(b, &[&mut x.t, null_mut(), null_mut(), &mut w.t], h, 1, 0),
                3 => {
                    let mut x3 = x_bf16(3);
                    dispatch_call(b, &[&mut x3.t, null_mut(), null_mut(), null_mut()], h, 1, 0)
                }
                4 => {
                    unsafe { fep_handle_destroy(h) };
                    dispatch_call(b, &[&mut x.t, null_mut(), null_mut(), null_mut()], h, 1, 0)
                }
                5 => {
                    let other = buffer();
                    let (h2, _) = dispatched(other, 4, false);
                    dispatch_call(b, &[&mut x.t, null_mut(), null_mut(), null_mut()], h2, 1, 0)
                }
                6 => dispatch_call(
                    b,
                    &[&mut x.t, null_mut(), null_mut(), null_mut()],
                    0x1000usize as *const fep_handle,
                    1,
                    0,
                ),
                _ => dispatch_call(b, &[&mut x.t, null_mut(), null_mut(), null_mut()], h, 1, 2),
            }
        }
    };
    case(c, "fep_dispatch/cached_valid", Want::Accept, cached(0));
    case(c, "fep_dispatch/cached_with_topk", Want::Refuse(&["topk_idx"]), cached(1));
    case(c, "fep_dispatch/cached_with_weights", Want::Refuse(&["topk_weights"]), cached(2));
    case(c, "fep_dispatch/cached_other_tokens", Want::Refuse(&["x"]), cached(3));
    case(c, "fep_dispatch/cached_destroyed", Want::Refuse(&["cached"]), cached(4));
    case(c, "fep_dispatch/cached_other_buffer", Want::Refuse(&["cached"]), cached(5));
    case(c, "fep_dispatch/cached_foreign", Want::Refuse(&["cached"]), cached(6));
    case(c, "fep_dispatch/cached_worst_too_few", Want::Refuse(&["num_worst_tokens"]), cached(7));
    // Copy-out of a dispatch's outputs (4 tokens, top-2 to a world of 1: 4 rows).
    const OUT: &[(&str, i32, bool)] = &[
        ("recv_x", FEP_DTYPE_BF16, false),
        ("recv_topk_idx", FEP_DTYPE_I64, true),
        ("recv_topk_weights", FEP_DTYPE_F32, true),
        ("num_recv_tokens_per_expert", FEP_DTYPE_I32, true),
    ];
    tensor_matrix(c, "fep_handle_copy_out", OUT, |i, m| {
        let b = buffer();
        let (h, rows) = dispatched(b, 4, false);
        let mut ts = vec![
            ten(FEP_DTYPE_BF16, &[rows, H]),
            ten(FEP_DTYPE_I64, &[rows, K]),
            ten(FEP_DTYPE_F32, &[rows, K]),
            ten(FEP_DTYPE_I32, &[L]),
        ];
        let p = ptrs(&mut ts, i, m);
        got(unsafe { fep_handle_copy_out(h, p[0], null_mut(), p[1], p[2], p[3]) })
    });
    const OUT8: &[(&str, i32, bool)] = &[("recv_x_scales", FEP_DTYPE_F32, true)];
    tensor_matrix(c, "fep_handle_copy_out_fp8", OUT8, |i, m| {
        let b = fp8_buffer();
        let (h, rows) = dispatched(b, 4, true);
        let mut x = ten(FEP_DTYPE_FP8_E4M3, &[rows, H]);
        let mut ts = vec![ten(FEP_DTYPE_F32, &[rows, H / 128])];
        let p = ptrs(&mut ts, i, m);
        got(unsafe { fep_handle_copy_out(h, &mut x.t, p[0], null_mut(), null_mut(), null_mut()) })
    });
    let copy = |which: u8| {
        move || {
            let b = if which == 4 { fp8_buffer() } else { buffer() };
            let (h, rows) = dispatched(b, if which == 3 { 0 } else { 4 }, which == 4);
            let mut x =
                ten(if which == 4 { FEP_DTYPE_FP8_E4M3 } else { FEP_DTYPE_BF16 }, &[rows, H]);
            match which {
                0 => got(unsafe {
                    fep_handle_copy_out(h, &mut x.t, null_mut(), null_mut(), null_mut(), null_mut())
                }),
                1 => {
                    setup(
                        unsafe {
                            fep_handle_copy_out(
                                h,
                                &mut x.t,
                                null_mut(),
                                null_mut(),
                                null_mut(),
                                null_mut(),
                            )
                        },
                        "copy_out",
                    );
                    got(unsafe {
                        fep_handle_copy_out(
                            h,
                            &mut x.t,
                            null_mut(),
                            null_mut(),
                            null_mut(),
                            null_mut(),
                        )
                    })
                }
                2 => {
                    unsafe { fep_handle_destroy(h) };
                    got(unsafe {
                        fep_handle_copy_out(
                            h,
                            &mut x.t,
                            null_mut(),
                            null_mut(),
                            null_mut(),
                            null_mut(),
                        )
                    })
                }
                3 => got(unsafe {
                    fep_handle_copy_out(h, &mut x.t, null_mut(), null_mut(), null_mut(), null_mut())
                }),
                4 => {
                    let mut bx = ten(FEP_DTYPE_BF16, &[rows, H]);
                    got(unsafe {
                        fep_handle_copy_out(
                            h,
                            &mut bx.t,
                            null_mut(),
                            null_mut(),
                            null_mut(),
                            null_mut(),
                        )
                    })
                }
                _ => got(unsafe {
                    fep_handle_copy_out(
                        null_mut(),
                        &mut x.t,
                        null_mut(),
                        null_mut(),
                        null_mut(),
                        null_mut(),
                    )
                }),
            }
        }
    };
    case(c, "fep_handle_copy_out/valid", Want::Accept, copy(0));
    case(c, "fep_handle_copy_out/twice", Want::Refuse(&["handle"]), copy(1));
    case(c, "fep_handle_copy_out/destroyed", Want::Refuse(&["handle"]), copy(2));
    case(c, "fep_handle_copy_out/zero_rows", Want::Accept, copy(3));
    case(c, "fep_handle_copy_out/fp8_into_bf16", Want::Refuse(&["recv_x"]), copy(4));
    case(c, "fep_handle_copy_out/null", Want::Refuse(&["handle"]), copy(5));
    case(c, "fep_handle_num_recv_tokens/destroyed", Want::Refuse(&["handle"]), || {
        let b = buffer();
        let (h, _) = dispatched(b, 4, false);
        unsafe { fep_handle_destroy(h) };
        match unsafe { fep_handle_num_recv_tokens(h) } {
            -1 => Got { st: FEP_ERR_INVALID_ARGUMENT as i32, msg: "handle: -1".into() },
            n => Got { st: 0, msg: format!("{n} rows of a destroyed handle") },
        }
    });
    case(c, "fep_handle_num_recv_tokens/valid", Want::Accept, || {
        let b = buffer();
        let (h, rows) = dispatched(b, 4, false);
        match unsafe { fep_handle_num_recv_tokens(h) } {
            n if n == rows => Got { st: 0, msg: String::new() },
            n => Got { st: FEP_ERR_INTERNAL as i32, msg: format!("{n} rows, expected {rows}") },
        }
    });
}

fn combine_cases(c: &mut Vec<Case>) {
    // NULL topk_weights with a combined_topk_weights given is refused (nothing would be
    // written to it), so topk_weights is not optional here.
    const T: &[(&str, i32, bool)] = &[
        ("x", FEP_DTYPE_BF16, false),
        ("topk_weights", FEP_DTYPE_F32, false),
        ("combined_x", FEP_DTYPE_BF16, false),
        ("combined_topk_weights", FEP_DTYPE_F32, true),
    ];
    tensor_matrix(c, "fep_combine", T, |i, m| {
        let b = buffer();
        let (h, rows) = dispatched(b, 4, false);
        let mut ts = vec![
            ten(FEP_DTYPE_BF16, &[rows, H]),
            weights(rows),
            ten(FEP_DTYPE_BF16, &[4, H]),
            ten(FEP_DTYPE_F32, &[4, K]),
        ];
        let p = ptrs(&mut ts, i, m);
        got(unsafe { fep_combine(b, h, p[0], p[1], p[2], p[3], null_mut()) })
    });
    let comb = |which: u8| {
        move || {
            let b = buffer();
            let (h, rows) = dispatched(b, if which == 1 { 0 } else { 4 }, false);
            let t = if which == 1 { 0 } else { 4 };
            let (x, w, mut cx, mut cw) = (
                ten(FEP_DTYPE_BF16, &[rows, H]),
                weights(rows),
                ten(FEP_DTYPE_BF16, &[t, H]),
                ten(FEP_DTYPE_F32, &[t, K]),
            );
            let (bb, hh, s): (*mut fep_buffer, *const fep_handle, *mut c_void) = match which {
                2 => (null_mut(), h, null_mut()),
                3 => (destroyed_buffer(), h, null_mut()),
                4 => (b, null(), null_mut()),
                5 => {
                    unsafe { fep_handle_destroy(h) };
                    (b, h, null_mut())
                }
                6 => (b, h, 0x10usize as *mut c_void),
                7 => {
                    let other = buffer();
                    (other, h, null_mut())
                }
                _ => (b, h, null_mut()),
            };
            if which == 8 {
                let mut wv = vec![0.5f32; (rows * K) as usize];
                wv[1] = f32::NAN;
                let wn = weights_of(rows, &wv);
                return got(unsafe { fep_combine(bb, hh, &x.t, &wn.t, &mut cx.t, &mut cw.t, s) });
            }
            if which == 9 {
                return got(unsafe { fep_combine(bb, hh, &x.t, null(), &mut cx.t, &mut cw.t, s) });
            }
            got(unsafe { fep_combine(bb, hh, &x.t, &w.t, &mut cx.t, &mut cw.t, s) })
        }
    };
    case(c, "fep_combine/valid", Want::Accept, comb(0));
    case(c, "fep_combine/zero_tokens", Want::Accept, comb(1));
    case(c, "fep_combine/buf_null", Want::Refuse(&["buf"]), comb(2));
    case(c, "fep_combine/buf_destroyed", Want::Refuse(&["buf"]), comb(3));
    case(c, "fep_combine/handle_null", Want::Refuse(&["handle"]), comb(4));
    case(c, "fep_combine/handle_destroyed", Want::Refuse(&["handle"]), comb(5));
    case(c, "fep_combine/stream_given", Want::Refuse(&["stream"]), comb(6));
    case(c, "fep_combine/handle_other_buffer", Want::Refuse(&["handle"]), comb(7));
    case(c, "fep_combine/weights_nan", Want::Refuse(&["topk_weights"]), comb(8));
    case(
        c,
        "fep_combine/out_weights_without_weights",
        Want::Refuse(&["combined_topk_weights"]),
        comb(9),
    );
}

#[allow(clippy::type_complexity)]
fn ll_cases(c: &mut Vec<Case>) {
    const D: &[(&str, i32, bool)] =
        &[("x", FEP_DTYPE_BF16, false), ("topk_idx", FEP_DTYPE_I64, false)];
    tensor_matrix(c, "fep_low_latency_dispatch", D, |i, m| {
        let b = buffer();
        let mut ts = vec![x_bf16(4), idx(4)];
        let p = ptrs(&mut ts, i, m);
        let mut op = null_mut();
        got(unsafe {
            fep_low_latency_dispatch(b, p[0], p[1], false, false, false, null_mut(), &mut op)
        })
    });
    #[derive(Clone, Copy)]
    struct Ld {
        t: i64,
        idx: Option<[i64; 8]>,
        fp8: bool,
        round: bool,
        hook: bool,
        hidden: i32,
        stream: bool,
        out_null: bool,
        buf: u8,
    }
    let base = Ld {
        t: 4,
        idx: None,
        fp8: false,
        round: false,
        hook: false,
        hidden: H as i32,
        stream: false,
        out_null: false,
        buf: 0,
    };
    let run = move |d: Ld| {
        move || {
            let mut cfg = config();
            cfg.hidden = d.hidden;
            let b = match d.buf {
                0 => {
                    let (st, b) = create(&cfg);
                    setup(st, "fep_buffer_create");
                    b
                }
                1 => null_mut(),
                _ => destroyed_buffer(),
            };
            let h = d.hidden as i64;
            let x = ten_of(FEP_DTYPE_BF16, &[d.t, h], &vec![0x3f80u16; (d.t * h) as usize]);
            let i = match d.idx {
                Some(v) => idx_of(4, &v),
                None => idx(d.t),
            };
            let mut op = null_mut();
            let st = unsafe {
                fep_low_latency_dispatch(
                    b,
                    &x.t,
                    &i.t,
                    d.fp8,
                    d.round,
                    d.hook,
                    if d.stream { 0x10usize as *mut c_void } else { null_mut() },
                    if d.out_null { null_mut() } else { &mut op },
                )
            };
            if st == FEP_OK && d.hook {
                return got(unsafe { fep_ll_op_complete(b, op) });
            }
            got(st)
        }
    };
    let lds: &[(&str, Want, fn(&mut Ld))] = &[
        ("valid", Want::Accept, |_| {}),
        ("zero_tokens", Want::Accept, |d| d.t = 0),
        ("one_token", Want::Accept, |d| d.t = 1),
        ("max_tokens", Want::Accept, |d| d.t = MAXT as i64),
        ("all_minus_one", Want::Accept, |d| d.idx = Some([-1; 8])),
        ("fp8", Want::Accept, |d| d.fp8 = true),
        ("fp8_round_scale", Want::Accept, |d| (d.fp8, d.round) = (true, true)),
        ("hook", Want::Accept, |d| d.hook = true),
        ("too_many_tokens", Want::Refuse(&["x"]), |d| d.t = MAXT as i64 + 1),
        ("duplicate_expert", Want::Refuse(&["topk_idx"]), |d| {
            d.idx = Some([1, 1, 2, 3, 4, 5, 6, 7])
        }),
        ("idx_eq_experts", Want::Refuse(&["topk_idx"]), |d| d.idx = Some([0, 1, 2, 8, 4, 5, 6, 7])),
        ("idx_minus_two", Want::Refuse(&["topk_idx"]), |d| d.idx = Some([0, 1, -2, 3, 4, 5, 6, 7])),
        ("idx_min", Want::Refuse(&["topk_idx"]), |d| d.idx = Some([i64::MIN, 1, 2, 3, 4, 5, 6, 7])),
        ("idx_max", Want::Refuse(&["topk_idx"]), |d| d.idx = Some([0, 1, 2, 3, 4, 5, 6, i64::MAX])),
        ("round_scale_without_fp8", Want::Refuse(&["round_scale"]), |d| d.round = true),
        ("fp8_hidden_not_128", Want::Refuse(&["hidden", "use_fp8"]), |d| {
            (d.fp8, d.hidden) = (true, 192)
        }),
        ("stream_given", Want::Refuse(&["stream"]), |d| d.stream = true),
        ("out_op_null", Want::Refuse(&["out_op"]), |d| d.out_null = true),
        ("buf_null", Want::Refuse(&["buf"]), |d| d.buf = 1),
        ("buf_destroyed", Want::Refuse(&["buf"]), |d| d.buf = 2),
    ];
    for &(name, want, edit) in lds {
        let mut d = base;
        edit(&mut d);
        case(c, format!("fep_low_latency_dispatch/{name}"), want, run(d));
    }
    // Copy-out of a dispatch: L = 8 local experts, S = 16 rows each.
    const O: &[(&str, i32, bool)] = &[
        ("recv_x", FEP_DTYPE_BF16, false),
        ("recv_count", FEP_DTYPE_I32, true),
        ("src_rank", FEP_DTYPE_I32, true),
        ("src_idx", FEP_DTYPE_I32, true),
        ("layout_range", FEP_DTYPE_I64, true),
    ];
    tensor_matrix(c, "fep_ll_dispatch_copy_out", O, |i, m| {
        let b = buffer();
        let op = ll_dispatched(b, 4, false);
        let mut ts = vec![
            ten(FEP_DTYPE_BF16, &[L, S, H]),
            ten(FEP_DTYPE_I32, &[L]),
            ten(FEP_DTYPE_I32, &[L, S]),
            ten(FEP_DTYPE_I32, &[L, S]),
            ten(FEP_DTYPE_I64, &[L, 1]),
        ];
        let p = ptrs(&mut ts, i, m);
        got(unsafe { fep_ll_dispatch_copy_out(op, p[0], null_mut(), p[1], p[2], p[3], p[4]) })
    });
    const O8: &[(&str, i32, bool)] = &[("recv_x_scales", FEP_DTYPE_F32, true)];
    tensor_matrix(c, "fep_ll_dispatch_copy_out_fp8", O8, |i, m| {
        let b = buffer();
        let op = ll_dispatched(b, 4, true);
        let mut x = ten(FEP_DTYPE_FP8_E4M3, &[L, S, H]);
        let mut ts = vec![ten(FEP_DTYPE_F32, &[L, S, H / 128])];
        let p = ptrs(&mut ts, i, m);
        got(unsafe {
            fep_ll_dispatch_copy_out(
                op,
                &mut x.t,
                p[0],
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut(),
            )
        })
    });
    let ldc = |which: u8| {
        move || {
            let b = buffer();
            let mut x = ten(FEP_DTYPE_BF16, &[L, S, H]);
            let xp: *mut fep_tensor = &mut x.t;
            let copy = |op| unsafe {
                fep_ll_dispatch_copy_out(
                    op,
                    xp,
                    null_mut(),
                    null_mut(),
                    null_mut(),
                    null_mut(),
                    null_mut(),
                )
            };
            match which {
                0 => got(copy(ll_dispatched(b, 4, false))),
                1 => {
                    let op = ll_dispatched(b, 4, false);
                    setup(copy(op), "copy");
                    got(copy(op))
                }
                2 => {
                    let op = ll_dispatched(b, 4, false);
                    unsafe { fep_ll_op_destroy(op) };
                    got(copy(op))
                }
                3 => {
                    let (xx, i) = (x_bf16(4), idx(4));
                    let mut op = null_mut();
                    setup(
                        unsafe {
                            fep_low_latency_dispatch(
                                b,
                                &xx.t,
                                &i.t,
                                false,
                                false,
                                true,
                                null_mut(),
                                &mut op,
                            )
                        },
                        "hooked dispatch",
                    );
                    got(copy(op))
                }
                4 => got(copy(ll_combined(b, 4))),
                5 => got(copy(null_mut())),
                _ => got(copy(ll_dispatched(b, 0, false))),
            }
        }
    };
    case(c, "fep_ll_dispatch_copy_out/valid", Want::Accept, ldc(0));
    case(c, "fep_ll_dispatch_copy_out/twice", Want::Refuse(&["op"]), ldc(1));
    case(c, "fep_ll_dispatch_copy_out/destroyed", Want::Refuse(&["op"]), ldc(2));
    case(c, "fep_ll_dispatch_copy_out/pending", Want::Refuse(&["op"]), ldc(3));
    case(c, "fep_ll_dispatch_copy_out/combine_op", Want::Refuse(&["op"]), ldc(4));
    case(c, "fep_ll_dispatch_copy_out/null", Want::Refuse(&["op"]), ldc(5));
    case(c, "fep_ll_dispatch_copy_out/zero_tokens", Want::Accept, ldc(6));
    // Combine.
    const C: &[(&str, i32, bool)] = &[
        ("x", FEP_DTYPE_BF16, false),
        ("topk_idx", FEP_DTYPE_I64, false),
        ("topk_weights", FEP_DTYPE_F32, false),
    ];
    tensor_matrix(c, "fep_low_latency_combine", C, |i, m| {
        let b = buffer();
        let d = ll_dispatched(b, 4, false);
        let mut ts = vec![ten(FEP_DTYPE_BF16, &[L, S, H]), idx(4), weights(4)];
        let p = ptrs(&mut ts, i, m);
        let mut op = null_mut();
        got(unsafe { fep_low_latency_combine(b, d, p[0], p[1], p[2], false, null_mut(), &mut op) })
    });
    let lc = |which: u8| {
        move || {
            let b = buffer();
            let d = ll_dispatched(b, 4, false);
            let (x, mut i, mut w) = (ten(FEP_DTYPE_BF16, &[L, S, H]), idx(4), weights(4));
            let (mut bb, mut dd, mut s, mut out, mut hook) =
                (b, d as *const fep_ll_op, null_mut(), true, false);
            let mut op = null_mut();
            match which {
                1 => setup(unsafe { fep_clean_low_latency_buffer(b) }, "clean"),
                2 => unsafe { fep_ll_op_destroy(d) },
                3 => dd = ll_combined(b, 4),
                4 => {
                    let (xx, ii) = (x_bf16(4), idx(4));
                    let mut p = null_mut();
                    setup(
                        unsafe {
                            fep_low_latency_dispatch(
                                b,
                                &xx.t,
                                &ii.t,
                                false,
                                false,
                                true,
                                null_mut(),
                                &mut p,
                            )
                        },
                        "hooked",
                    );
                    dd = p;
                }
                5 => i = idx_of(4, &[1, 0, 2, 3, 4, 5, 6, 7]),
                6 => i = idx_of(4, &[-1; 8]),
                7 => {
                    let mut wv = [0.5f32; 8];
                    wv[2] = f32::NAN;
                    w = weights_of(4, &wv);
                }
                8 => dd = null(),
                9 => bb = null_mut(),
                10 => s = 0x10usize as *mut c_void,
                11 => out = false,
                12 => bb = buffer(),
                13 => hook = true,
                _ => {}
            }
            let st = unsafe {
                fep_low_latency_combine(
                    bb,
                    dd,
                    &x.t,
                    &i.t,
                    &w.t,
                    hook,
                    s,
                    if out { &mut op } else { null_mut() },
                )
            };
            if st == FEP_OK && hook {
                return got(unsafe { fep_ll_op_complete(bb, op) });
            }
            got(st)
        }
    };
    case(c, "fep_low_latency_combine/valid", Want::Accept, lc(0));
    case(c, "fep_low_latency_combine/stale_after_clean", Want::Refuse(&["dispatch_op"]), lc(1));
    case(c, "fep_low_latency_combine/dispatch_destroyed", Want::Refuse(&["dispatch_op"]), lc(2));
    case(c, "fep_low_latency_combine/dispatch_is_combine", Want::Refuse(&["dispatch_op"]), lc(3));
    case(c, "fep_low_latency_combine/dispatch_pending", Want::Refuse(&["dispatch_op"]), lc(4));
    case(c, "fep_low_latency_combine/idx_differs", Want::Refuse(&["topk_idx"]), lc(5));
    // A -1 in the combine's topk_idx masks an expert out of the sum (DeepEP's).
    case(c, "fep_low_latency_combine/idx_masked", Want::Accept, lc(6));
    case(c, "fep_low_latency_combine/weights_nan", Want::Refuse(&["topk_weights"]), lc(7));
    case(c, "fep_low_latency_combine/dispatch_null", Want::Refuse(&["dispatch_op"]), lc(8));
    case(c, "fep_low_latency_combine/buf_null", Want::Refuse(&["buf"]), lc(9));
    case(c, "fep_low_latency_combine/stream_given", Want::Refuse(&["stream"]), lc(10));
    case(c, "fep_low_latency_combine/out_op_null", Want::Refuse(&["out_op"]), lc(11));
    case(c, "fep_low_latency_combine/other_buffer", Want::Refuse(&["dispatch_op"]), lc(12));
    case(c, "fep_low_latency_combine/hook", Want::Accept, lc(13));
    // Combine copy-out: T = 4 tokens.
    const CO: &[(&str, i32, bool)] = &[("combined_x", FEP_DTYPE_BF16, false)];
    tensor_matrix(c, "fep_ll_combine_copy_out", CO, |i, m| {
        let b = buffer();
        let op = ll_combined(b, 4);
        let mut ts = vec![ten(FEP_DTYPE_BF16, &[4, H])];
        let p = ptrs(&mut ts, i, m);
        got(unsafe { fep_ll_combine_copy_out(op, p[0]) })
    });
    let lcc = |which: u8| {
        move || {
            let b = buffer();
            let t = if which == 6 { 0 } else { 4 };
            let op = ll_combined(b, t);
            let rows = match which {
                3 => 3,
                4 => 0,
                5 => 5,
                _ => t,
            };
            let mut x = ten(FEP_DTYPE_BF16, &[rows, H]);
            match which {
                1 => {
                    setup(unsafe { fep_ll_combine_copy_out(op, &mut x.t) }, "copy");
                    got(unsafe { fep_ll_combine_copy_out(op, &mut x.t) })
                }
                2 => got(unsafe { fep_ll_combine_copy_out(ll_dispatched(b, 4, false), &mut x.t) }),
                7 => {
                    unsafe { fep_ll_op_destroy(op) };
                    got(unsafe { fep_ll_combine_copy_out(op, &mut x.t) })
                }
                _ => got(unsafe { fep_ll_combine_copy_out(op, &mut x.t) }),
            }
        }
    };
    case(c, "fep_ll_combine_copy_out/valid", Want::Accept, lcc(0));
    case(c, "fep_ll_combine_copy_out/twice", Want::Refuse(&["op"]), lcc(1));
    case(c, "fep_ll_combine_copy_out/dispatch_op", Want::Refuse(&["op"]), lcc(2));
    case(c, "fep_ll_combine_copy_out/fewer_rows", Want::Refuse(&["combined_x"]), lcc(3));
    case(c, "fep_ll_combine_copy_out/zero_rows", Want::Refuse(&["combined_x"]), lcc(4));
    case(c, "fep_ll_combine_copy_out/more_rows", Want::Refuse(&["combined_x"]), lcc(5));
    case(c, "fep_ll_combine_copy_out/zero_tokens", Want::Accept, lcc(6));
    case(c, "fep_ll_combine_copy_out/destroyed", Want::Refuse(&["op"]), lcc(7));
    // Completion.
    let comp = |which: u8| {
        move || {
            let b = buffer();
            match which {
                0 => got(unsafe { fep_ll_op_complete(b, ll_dispatched(b, 4, false)) }),
                1 => got(unsafe { fep_ll_op_complete(b, null_mut()) }),
                2 => {
                    let op = ll_dispatched(b, 4, false);
                    unsafe { fep_ll_op_destroy(op) };
                    got(unsafe { fep_ll_op_complete(b, op) })
                }
                3 => got(unsafe { fep_ll_op_complete(null_mut(), ll_dispatched(b, 4, false)) }),
                4 => got(unsafe { fep_ll_op_complete(b, 0x6000usize as *mut fep_ll_op) }),
                _ => {
                    let (x, i) = (x_bf16(4), idx(4));
                    let mut op = null_mut();
                    setup(
                        unsafe {
                            fep_low_latency_dispatch(
                                b,
                                &x.t,
                                &i.t,
                                false,
                                false,
                                true,
                                null_mut(),
                                &mut op,
                            )
                        },
                        "hooked",
                    );
                    let other = buffer();
                    got(unsafe { fep_ll_op_complete(other, op) })
                }
            }
        }
    };
    case(c, "fep_ll_op_complete/done_is_noop", Want::Accept, comp(0));
    case(c, "fep_ll_op_complete/op_null", Want::Refuse(&["op"]), comp(1));
    case(c, "fep_ll_op_complete/op_destroyed", Want::Refuse(&["op"]), comp(2));
    case(c, "fep_ll_op_complete/buf_null", Want::Refuse(&["buf"]), comp(3));
    case(c, "fep_ll_op_complete/op_foreign", Want::Refuse(&["op"]), comp(4));
    case(c, "fep_ll_op_complete/other_buffer", Want::Refuse(&["buf", "op"]), comp(5));
}

fn lifetime_cases(c: &mut Vec<Case>) {
    case(c, "fep_buffer_destroy/twice", Want::Refuse(&["buf"]), || {
        got(unsafe { fep_buffer_destroy(destroyed_buffer()) })
    });
    case(c, "fep_buffer_destroy/foreign", Want::Refuse(&["buf"]), || {
        got(unsafe { fep_buffer_destroy(0x8000usize as *mut fep_buffer) })
    });
    case(c, "fep_buffer_destroy/null", Want::Accept, || {
        got(unsafe { fep_buffer_destroy(null_mut()) })
    });
    case(c, "fep_buffer_destroy/handle_outlives", Want::Accept, || {
        // A handle freed after its buffer: its memory is its own.
        let b = buffer();
        let (h, _) = dispatched(b, 4, false);
        let op = ll_dispatched(b, 4, false);
        setup(unsafe { fep_buffer_destroy(b) }, "destroy");
        let g = got_void(|| unsafe { fep_handle_destroy(h) });
        if g.st != 0 {
            return g;
        }
        got_void(|| unsafe { fep_ll_op_destroy(op) })
    });
    case(c, "fep_buffer_rank/null", Want::Refuse(&["buf"]), || {
        let mut r = 0;
        got(unsafe { fep_buffer_rank(null_mut(), &mut r, null_mut()) })
    });
    case(c, "fep_buffer_rank/destroyed", Want::Refuse(&["buf"]), || {
        let mut r = 0;
        got(unsafe { fep_buffer_rank(destroyed_buffer(), &mut r, null_mut()) })
    });
    case(c, "fep_buffer_rank/outputs_null", Want::Accept, || {
        got(unsafe { fep_buffer_rank(buffer(), null_mut(), null_mut()) })
    });
    case(c, "fep_clean_low_latency_buffer/null", Want::Refuse(&["buf"]), || {
        got(unsafe { fep_clean_low_latency_buffer(null_mut()) })
    });
    case(c, "fep_clean_low_latency_buffer/destroyed", Want::Refuse(&["buf"]), || {
        got(unsafe { fep_clean_low_latency_buffer(destroyed_buffer()) })
    });
    case(c, "fep_clean_low_latency_buffer/valid", Want::Accept, || {
        got(unsafe { fep_clean_low_latency_buffer(buffer()) })
    });
    case(c, "fep_handle_destroy/twice", Want::Refuse(&["handle"]), || {
        let (h, _) = dispatched(buffer(), 4, false);
        unsafe { fep_handle_destroy(h) };
        got_void(|| unsafe { fep_handle_destroy(h) })
    });
    case(c, "fep_handle_destroy/foreign", Want::Refuse(&["handle"]), || {
        got_void(|| unsafe { fep_handle_destroy(0x1000usize as *mut fep_handle) })
    });
    case(c, "fep_handle_destroy/an_op", Want::Refuse(&["handle"]), || {
        let op = ll_dispatched(buffer(), 4, false);
        got_void(|| unsafe { fep_handle_destroy(op.cast()) })
    });
    case(c, "fep_handle_destroy/null", Want::Accept, || {
        got_void(|| unsafe { fep_handle_destroy(null_mut()) })
    });
    case(c, "fep_ll_op_destroy/twice", Want::Refuse(&["op"]), || {
        let op = ll_dispatched(buffer(), 4, false);
        unsafe { fep_ll_op_destroy(op) };
        got_void(|| unsafe { fep_ll_op_destroy(op) })
    });
    case(c, "fep_ll_op_destroy/foreign", Want::Refuse(&["op"]), || {
        got_void(|| unsafe { fep_ll_op_destroy(0x2000usize as *mut fep_ll_op) })
    });
    case(c, "fep_ll_op_destroy/a_handle", Want::Refuse(&["op"]), || {
        let (h, _) = dispatched(buffer(), 4, false);
        got_void(|| unsafe { fep_ll_op_destroy(h.cast()) })
    });
    case(c, "fep_ll_op_destroy/pending_hook", Want::Accept, || {
        let b = buffer();
        let (x, i) = (x_bf16(4), idx(4));
        let mut op = null_mut();
        setup(
            unsafe {
                fep_low_latency_dispatch(b, &x.t, &i.t, false, false, true, null_mut(), &mut op)
            },
            "hooked",
        );
        got_void(|| unsafe { fep_ll_op_destroy(op) })
    });
    case(c, "fep_ll_op_destroy/null", Want::Accept, || {
        got_void(|| unsafe { fep_ll_op_destroy(null_mut()) })
    });
}

fn gpu_cases(c: &mut Vec<Case>) {
    // Without a GPU every fep_gpu_* call meets a host buffer, NULL or a destroyed one: each
    // must refuse it by name before touching its other arguments.
    type G = fn(*mut fep_buffer) -> fep_status;
    let calls: &[(&str, G)] = &[
        ("fep_gpu_reserve", |b| unsafe { fep_gpu_reserve(b, 128, 1) }),
        ("fep_gpu_notify", |b| {
            let i = idx(4);
            let (mut h, mut n) = (null_mut(), 0);
            let o = fep_gpu_order {
                stream: null_mut(),
                wait_stream: null_mut(),
                wait_event: null_mut(),
                then_stream: null_mut(),
            };
            unsafe { fep_gpu_notify(b, &i.t, 1, 0, &o, &mut h, &mut n, null_mut()) }
        }),
        ("fep_gpu_notify_inputs", |b| {
            let (x, i, w) = (x_bf16(4), idx(4), weights(4));
            let (mut h, mut n) = (null_mut(), 0);
            let o = fep_gpu_order {
                stream: null_mut(),
                wait_stream: null_mut(),
                wait_event: null_mut(),
                then_stream: null_mut(),
            };
            unsafe {
                fep_gpu_notify_inputs(
                    b,
                    &x.t,
                    null(),
                    &i.t,
                    &w.t,
                    1,
                    0,
                    &o,
                    &mut h,
                    &mut n,
                    null_mut(),
                )
            }
        }),
        ("fep_gpu_dispatch", |b| {
            let (x, i, w) = (x_bf16(4), idx(4), weights(4));
            let o = fep_gpu_order {
                stream: null_mut(),
                wait_stream: null_mut(),
                wait_event: null_mut(),
                then_stream: null_mut(),
            };
            unsafe {
                fep_gpu_dispatch(
                    b,
                    null(),
                    &x.t,
                    null(),
                    &i.t,
                    &w.t,
                    &x.t,
                    null(),
                    &i.t,
                    &w.t,
                    &i.t,
                    &o,
                )
            }
        }),
        ("fep_gpu_combine", |b| {
            let (x, w) = (x_bf16(4), weights(4));
            let o = fep_gpu_order {
                stream: null_mut(),
                wait_stream: null_mut(),
                wait_event: null_mut(),
                then_stream: null_mut(),
            };
            unsafe { fep_gpu_combine(b, null(), &x.t, &w.t, &x.t, &w.t, &o) }
        }),
        ("fep_gpu_ll_dispatch", |b| {
            let (x, i) = (x_bf16(4), idx(4));
            let o = fep_gpu_order {
                stream: null_mut(),
                wait_stream: null_mut(),
                wait_event: null_mut(),
                then_stream: null_mut(),
            };
            let mut op = null_mut();
            unsafe { fep_gpu_ll_dispatch(b, &x.t, &i.t, false, false, false, null(), &o, &mut op) }
        }),
        ("fep_gpu_ll_complete", |b| {
            let o = fep_gpu_order {
                stream: null_mut(),
                wait_stream: null_mut(),
                wait_event: null_mut(),
                then_stream: null_mut(),
            };
            unsafe { fep_gpu_ll_complete(b, 0x9000usize as *mut fep_gpu_ll_op, &o) }
        }),
        ("fep_gpu_ll_combine", |b| {
            let (x, i, w) = (x_bf16(4), idx(4), weights(4));
            let o = fep_gpu_order {
                stream: null_mut(),
                wait_stream: null_mut(),
                wait_event: null_mut(),
                then_stream: null_mut(),
            };
            let mut op = null_mut();
            unsafe {
                fep_gpu_ll_combine(
                    b,
                    0x9000usize as *const fep_gpu_ll_op,
                    &x.t,
                    &i.t,
                    &w.t,
                    &x.t,
                    false,
                    &o,
                    &mut op,
                )
            }
        }),
        ("fep_gpu_ll_dispatch_ex", |b| {
            let (x, i, st) = (x_bf16(4), idx(4), ten(FEP_DTYPE_I64, &[1]));
            let o = fep_gpu_order {
                stream: null_mut(),
                wait_stream: null_mut(),
                wait_event: null_mut(),
                then_stream: null_mut(),
            };
            let mut op = null_mut();
            unsafe {
                fep_gpu_ll_dispatch_ex(
                    b,
                    &x.t,
                    &i.t,
                    false,
                    false,
                    false,
                    null(),
                    &st.t,
                    &o,
                    &mut op,
                )
            }
        }),
        ("fep_gpu_ll_combine_ex", |b| {
            let (x, i, w, st) = (x_bf16(4), idx(4), weights(4), ten(FEP_DTYPE_I64, &[1]));
            let o = fep_gpu_order {
                stream: null_mut(),
                wait_stream: null_mut(),
                wait_event: null_mut(),
                then_stream: null_mut(),
            };
            let mut op = null_mut();
            unsafe {
                fep_gpu_ll_combine_ex(
                    b,
                    0x9000usize as *const fep_gpu_ll_op,
                    &x.t,
                    &i.t,
                    &w.t,
                    &x.t,
                    false,
                    &st.t,
                    &o,
                    &mut op,
                )
            }
        }),
        ("fep_gpu_sync", |b| unsafe { fep_gpu_sync(b, null_mut()) }),
        ("fep_gpu_info", |b| {
            let (mut d, mut n, mut s) = (0, 0, null_mut());
            unsafe { fep_gpu_info(b, &mut d, &mut n, &mut s) }
        }),
    ];
    for &(name, f) in calls {
        case(c, format!("{name}/host_buffer"), Want::Refuse(&["buf"]), move || got(f(buffer())));
        case(c, format!("{name}/buf_null"), Want::Refuse(&["buf"]), move || got(f(null_mut())));
        case(c, format!("{name}/buf_destroyed"), Want::Refuse(&["buf"]), move || {
            got(f(destroyed_buffer()))
        });
    }
    case(c, "fep_gpu_ll_op_destroy/foreign", Want::Refuse(&["op"]), || {
        got_void(|| unsafe { fep_gpu_ll_op_destroy(0x9000usize as *mut fep_gpu_ll_op) })
    });
    case(c, "fep_gpu_ll_op_destroy/a_host_op", Want::Refuse(&["op"]), || {
        let op = ll_dispatched(buffer(), 4, false);
        got_void(|| unsafe { fep_gpu_ll_op_destroy(op.cast()) })
    });
    case(c, "fep_gpu_ll_op_destroy/null", Want::Accept, || {
        got_void(|| unsafe { fep_gpu_ll_op_destroy(null_mut()) })
    });
    case(c, "fep_gpu_create/no_device", Want::Bounded(&["device", "CUDA", "cuda"]), || {
        let mut cfg = config();
        cfg.backend = FEP_BACKEND_GPU;
        got(create(&cfg).0)
    });
}

/// A buffer in shrink mode (`fep_config.enable_shrink`).
fn shrink_buffer() -> *mut fep_buffer {
    let mut c = config();
    c.enable_shrink = 1;
    let (st, b) = create(&c);
    setup(st, "fep_buffer_create (enable_shrink)");
    b
}

/// DeepEP's further low-latency arguments: the wait-cost tensors of the `_ex` calls, shrink
/// mode's mask calls and the local region (`get_local_buffer_tensor`).
fn deepep_ll_cases(c: &mut Vec<Case>) {
    const W: &[(&str, i32, bool)] = &[("wait_recv_cost_stats", FEP_DTYPE_I64, true)];
    tensor_matrix(c, "fep_low_latency_dispatch_ex", W, |i, m| {
        let b = buffer();
        let (x, ix) = (x_bf16(4), idx(4));
        let mut ts = vec![ten(FEP_DTYPE_I64, &[1])];
        let p = ptrs(&mut ts, i, m);
        let mut op = null_mut();
        got(unsafe {
            fep_low_latency_dispatch_ex(
                b,
                &x.t,
                &ix.t,
                false,
                false,
                false,
                p[0],
                null_mut(),
                &mut op,
            )
        })
    });
    tensor_matrix(c, "fep_low_latency_combine_ex", W, |i, m| {
        let b = buffer();
        let d = ll_dispatched(b, 4, false);
        let (x, ix, w) = (ten(FEP_DTYPE_BF16, &[L, S, H]), idx(4), weights(4));
        let mut ts = vec![ten(FEP_DTYPE_I64, &[1])];
        let p = ptrs(&mut ts, i, m);
        let mut op = null_mut();
        got(unsafe {
            fep_low_latency_combine_ex(b, d, &x.t, &ix.t, &w.t, false, p[0], null_mut(), &mut op)
        })
    });
    case(c, "fep_low_latency_dispatch_ex/stats_added", Want::Accept, || {
        // The receive adds to the caller's values (world 1: rank 0's own messages).
        let b = buffer();
        let (x, ix) = (x_bf16(4), idx(4));
        let st = ten_of(FEP_DTYPE_I64, &[1], &[-5i64]);
        let mut op = null_mut();
        let g = got(unsafe {
            fep_low_latency_dispatch_ex(
                b,
                &x.t,
                &ix.t,
                false,
                false,
                true,
                &st.t as *const _ as *mut _,
                null_mut(),
                &mut op,
            )
        });
        if g.st != 0 {
            return g;
        }
        let before = unsafe { *st.t.data.cast::<i64>() };
        let g = got(unsafe { fep_ll_op_complete(b, op) });
        let after = unsafe { *st.t.data.cast::<i64>() };
        if g.st == 0 && (before != -5 || after < -5) {
            return Got { st: FEP_ERR_INTERNAL as i32, msg: format!("stats {before} -> {after}") };
        }
        g
    });

    type Mk = fn() -> *mut fep_buffer;
    type Call = fn(*mut fep_buffer) -> fep_status;
    let mask_calls: &[(&str, Call)] = &[
        ("fep_ll_update_mask", |b| unsafe { fep_ll_update_mask(b, 0, true) }),
        ("fep_ll_query_mask", |b| {
            let t = ten(FEP_DTYPE_I32, &[1]);
            unsafe { fep_ll_query_mask(b, &t.t as *const _ as *mut _) }
        }),
        ("fep_ll_clean_mask", |b| unsafe { fep_ll_clean_mask(b) }),
    ];
    for &(name, f) in mask_calls {
        case(c, format!("{name}/no_shrink"), Want::Refuse(&["enable_shrink"]), move || {
            got(f(buffer()))
        });
        case(c, format!("{name}/buf_null"), Want::Refuse(&["buf"]), move || got(f(null_mut())));
        case(c, format!("{name}/buf_destroyed"), Want::Refuse(&["buf"]), move || {
            got(f(destroyed_buffer()))
        });
        case(c, format!("{name}/valid"), Want::Accept, move || got(f(shrink_buffer())));
    }
    for (name, rank) in [("rank_neg", -1), ("rank_past", 1), ("rank_min", i32::MIN)] {
        case(c, format!("fep_ll_update_mask/{name}"), Want::Refuse(&["rank"]), move || {
            got(unsafe { fep_ll_update_mask(shrink_buffer(), rank, true) })
        });
    }
    const Q: &[(&str, i32, bool)] = &[("mask_status", FEP_DTYPE_I32, false)];
    tensor_matrix(c, "fep_ll_query_mask", Q, |i, m| {
        let b = shrink_buffer();
        let mut ts = vec![ten(FEP_DTYPE_I32, &[1])];
        let p = ptrs(&mut ts, i, m);
        got(unsafe { fep_ll_query_mask(b, p[0]) })
    });
    case(c, "fep_ll_query_mask/reports_the_mask", Want::Accept, || {
        let b = shrink_buffer();
        let t = ten(FEP_DTYPE_I32, &[1]);
        setup(unsafe { fep_ll_update_mask(b, 0, true) }, "fep_ll_update_mask");
        let g = got(unsafe { fep_ll_query_mask(b, &t.t as *const _ as *mut _) });
        let v = unsafe { *t.t.data.cast::<i32>() };
        if g.st == 0 && v != 1 {
            return Got { st: FEP_ERR_INTERNAL as i32, msg: format!("mask_status {v}, want 1") };
        }
        g
    });

    // fep_buffer_local_region
    let region = |b: *mut fep_buffer, r: i32| -> Got {
        let (mut p, mut n) = (null_mut::<c_void>(), 0u64);
        got(unsafe { fep_buffer_local_region(b, r, &mut p, &mut n) })
    };
    let mk: &[(&str, Mk)] = &[("null", || null_mut()), ("destroyed", destroyed_buffer)];
    for &(name, f) in mk {
        case(c, format!("fep_buffer_local_region/buf_{name}"), Want::Refuse(&["buf"]), move || {
            region(f(), FEP_REGION_NORMAL)
        });
    }
    for (name, r) in [("region_2", 2), ("region_neg", -1), ("region_max", i32::MAX)] {
        case(c, format!("fep_buffer_local_region/{name}"), Want::Refuse(&["region"]), move || {
            region(buffer(), r)
        });
    }
    case(c, "fep_buffer_local_region/data_null", Want::Refuse(&["data"]), || {
        let mut n = 0u64;
        got(unsafe { fep_buffer_local_region(buffer(), FEP_REGION_NORMAL, null_mut(), &mut n) })
    });
    case(c, "fep_buffer_local_region/bytes_null", Want::Refuse(&["bytes"]), || {
        let mut p = null_mut::<c_void>();
        got(unsafe { fep_buffer_local_region(buffer(), FEP_REGION_NORMAL, &mut p, null_mut()) })
    });
    case(
        c,
        "fep_buffer_local_region/low_latency_not_connected",
        Want::Refuse(&["region"]),
        move || region(buffer(), FEP_REGION_LOW_LATENCY),
    );
    case(c, "fep_buffer_local_region/normal", Want::Accept, || {
        let b = buffer();
        let (mut p, mut n) = (null_mut::<c_void>(), 0u64);
        let g = got(unsafe { fep_buffer_local_region(b, FEP_REGION_NORMAL, &mut p, &mut n) });
        if g.st == 0 && (p.is_null() || n == 0) {
            return Got { st: FEP_ERR_INTERNAL as i32, msg: format!("{p:?}, {n} bytes") };
        }
        g
    });
    case(c, "fep_buffer_local_region/low_latency", Want::Accept, || {
        // After a low-latency dispatch its rows are in the region.
        let b = buffer();
        let op = ll_dispatched(b, 4, false);
        let (mut p, mut n) = (null_mut::<c_void>(), 0u64);
        let g = got(unsafe { fep_buffer_local_region(b, FEP_REGION_LOW_LATENCY, &mut p, &mut n) });
        if g.st != 0 {
            return g;
        }
        let region = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n as usize) };
        let x = x_bf16(4);
        let row = unsafe { std::slice::from_raw_parts(x.t.data.cast::<u8>(), 2 * H as usize) };
        unsafe { fep_ll_op_destroy(op) };
        if !region.windows(row.len()).any(|w| w == row) {
            return Got {
                st: FEP_ERR_INTERNAL as i32,
                msg: "the dispatched row is not there".into(),
            };
        }
        g
    });
}

fn misc_cases(c: &mut Vec<Case>) {
    for (name, v) in [("ok", 0), ("min", i32::MIN), ("max", i32::MAX), ("neg", -1), ("7099", 7099)]
    {
        case(c, format!("fep_status_string/{name}"), Want::Accept, move || {
            let p = fep_status_string(v);
            if p.is_null() {
                return Got { st: FEP_ERR_INTERNAL as i32, msg: "NULL".into() };
            }
            let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
            Got { st: if s.is_empty() { FEP_ERR_INTERNAL as i32 } else { 0 }, msg: s }
        });
    }
    case(c, "fep_abi_version/matches", Want::Accept, || Got {
        st: if fep_abi_version() == FEP_ABI_VERSION { 0 } else { FEP_ERR_VERSION as i32 },
        msg: String::new(),
    });
}

// ---------------------------------------------------------------------------------------------
// fep_ep: DeepEP's per-call shape
// ---------------------------------------------------------------------------------------------

fn ep_config() -> fep_ep_config {
    let mut c = std::mem::MaybeUninit::<fep_ep_config>::uninit();
    unsafe {
        setup(fep_ep_config_init(c.as_mut_ptr()), "fep_ep_config_init");
        let mut c = c.assume_init();
        (c.rank, c.num_ranks, c.ranks_per_node, c.local_rank) = (0, 1, 1, 0);
        c.low_latency_mode = 1;
        c.timeout_s = 10.0;
        c
    }
}

fn ep_create(c: &fep_ep_config) -> (fep_status, *mut fep_ep) {
    let mut ep = null_mut();
    let st = unsafe { fep_ep_create(c, Some(copy_gather), null_mut(), &mut ep) };
    (st, ep)
}

fn ep_with(c: &fep_ep_config) -> *mut fep_ep {
    let (st, ep) = ep_create(c);
    setup(st, "fep_ep_create");
    ep
}

fn live_ep() -> *mut fep_ep {
    ep_with(&ep_config())
}

fn destroyed_ep() -> *mut fep_ep {
    let ep = live_ep();
    setup(unsafe { fep_ep_destroy(ep) }, "fep_ep_destroy");
    ep
}

/// A shape as `fep_ep_buffer` / `fep_ep_need_bytes` take it.
#[derive(Clone, Copy)]
struct Shp {
    mode: i32,
    experts: i32,
    hidden: i32,
    topk: i32,
    dtype: i32,
    maxt: i32,
}

const NORMAL: Shp = Shp {
    mode: FEP_MODE_NORMAL,
    experts: E,
    hidden: H as i32,
    topk: K as i32,
    dtype: FEP_DTYPE_BF16,
    maxt: 0,
};
const LOW: Shp = Shp { mode: FEP_MODE_LOW_LATENCY, maxt: MAXT, ..NORMAL };

fn ep_buffer_of(ep: *mut fep_ep, s: Shp) -> (fep_status, *mut fep_buffer) {
    let mut b = null_mut();
    let st =
        unsafe { fep_ep_buffer(ep, s.mode, s.experts, s.hidden, s.topk, s.dtype, s.maxt, &mut b) };
    (st, b)
}

fn ep_buffer(ep: *mut fep_ep, s: Shp) -> *mut fep_buffer {
    let (st, b) = ep_buffer_of(ep, s);
    setup(st, "fep_ep_buffer");
    b
}

fn need_of(c: &fep_ep_config, num_ranks: i32, s: Shp) -> (fep_status, u64) {
    let mut n = 0u64;
    let st = unsafe {
        fep_ep_need_bytes(
            c, num_ranks, s.mode, s.experts, s.hidden, s.topk, s.dtype, s.maxt, &mut n,
        )
    };
    (st, n)
}

fn need(c: &fep_ep_config, s: Shp) -> u64 {
    let (st, n) = need_of(c, 1, s);
    setup(st, "fep_ep_need_bytes");
    n
}

type EpEdit = fn(&mut fep_ep_config);

/// (name, arguments the refusal may name, whether `fep_ep_need_bytes` refuses it too: it does
/// not use the rank fields, so only their ranges are its concern, edit).
const EP_CONFIG_EDITS: &[(&str, &[&str], bool, EpEdit)] = &[
    ("timeout_nan", &["timeout_s"], true, |c| c.timeout_s = f64::NAN),
    ("timeout_neg", &["timeout_s"], true, |c| c.timeout_s = -1.0),
    ("timeout_inf", &["timeout_s"], true, |c| c.timeout_s = f64::INFINITY),
    ("timeout_neg_inf", &["timeout_s"], true, |c| c.timeout_s = f64::NEG_INFINITY),
    ("timeout_1e300", &["timeout_s"], true, |c| c.timeout_s = 1e300),
    ("num_nvl_bytes_neg", &["num_nvl_bytes"], true, |c| c.num_nvl_bytes = -1),
    ("num_nvl_bytes_min", &["num_nvl_bytes"], true, |c| c.num_nvl_bytes = i64::MIN),
    ("num_rdma_bytes_neg", &["num_rdma_bytes"], true, |c| c.num_rdma_bytes = -4096),
    ("low_latency_mode_2", &["low_latency_mode"], true, |c| c.low_latency_mode = 2),
    ("low_latency_mode_neg", &["low_latency_mode"], true, |c| c.low_latency_mode = -1),
    ("backend_5", &["backend"], true, |c| c.backend = 5),
    ("backend_neg", &["backend"], true, |c| c.backend = -1),
    ("num_sms_neg", &["num_sms"], true, |c| c.num_sms = -2),
    ("chunk_tokens_neg", &["chunk_tokens"], true, |c| c.chunk_tokens = -1),
    ("slots_per_peer_neg", &["slots_per_peer"], true, |c| c.slots_per_peer = -3),
    ("ranks_per_node_neg", &["ranks_per_node"], true, |c| c.ranks_per_node = -1),
    ("ranks_per_node_big", &["ranks_per_node"], false, |c| c.ranks_per_node = 3),
    ("local_rank_neg", &["local_rank"], true, |c| c.local_rank = -5),
    ("local_rank_big", &["local_rank"], false, |c| c.local_rank = 4),
    ("rank_neg", &["rank"], true, |c| c.rank = -7),
    ("rank_big", &["rank"], false, |c| c.rank = 1),
    ("rank_min", &["rank"], true, |c| c.rank = i32::MIN),
    ("num_ranks_neg", &["num_ranks"], true, |c| c.num_ranks = -2),
    ("num_ranks_zero", &["num_ranks"], true, |c| c.num_ranks = 0),
    ("device_neg", &["device"], true, |c| c.device = -2),
    ("gpu_reserve_neg", &["gpu_reserve_tokens"], true, |c| c.gpu_reserve_tokens = -2),
    ("hier_2", &["internode_hierarchy"], true, |c| c.internode_hierarchy = 2),
    ("hier_host", &["internode_hierarchy"], false, |c| c.internode_hierarchy = 1),
    ("struct_size_0", &["cfg"], true, |c| c.struct_size = 0),
    ("struct_size_8", &["cfg"], true, |c| c.struct_size = 8),
    ("struct_size_less", &["cfg"], true, |c| c.struct_size -= 8),
    ("struct_size_more", &["cfg"], true, |c| c.struct_size += 8),
    ("struct_size_4096", &["cfg"], true, |c| c.struct_size = 4096),
    ("struct_size_max", &["cfg"], true, |c| c.struct_size = u32::MAX),
    ("version_0", &["cfg"], true, |c| c.version = 0),
    ("version_99", &["cfg"], true, |c| c.version = 99),
];

/// Sizes that would allocate without bound: a clean refusal or a buffer, never an abort.
const EP_CONFIG_HUGE: &[(&str, &[&str], EpEdit)] = &[
    ("chunk_tokens_max", &["chunk_tokens"], |c| c.chunk_tokens = i32::MAX),
    ("slots_per_peer_max", &["slots_per_peer"], |c| c.slots_per_peer = i32::MAX),
    ("num_sms_max", &["num_sms"], |c| c.num_sms = i32::MAX),
];

type ShpEdit = fn(&mut Shp);

/// Shapes `fep_ep_buffer` and `fep_ep_need_bytes` refuse (a world of 1 rank).
const SHAPE_EDITS: &[(&str, &[&str], ShpEdit)] = &[
    ("mode_0", &["mode"], |s| s.mode = 0),
    ("mode_both", &["mode"], |s| s.mode = FEP_MODE_NORMAL | FEP_MODE_LOW_LATENCY),
    ("mode_neg", &["mode"], |s| s.mode = -1),
    ("mode_99", &["mode"], |s| s.mode = 99),
    ("num_experts_zero", &["num_experts"], |s| s.experts = 0),
    ("num_experts_neg", &["num_experts"], |s| s.experts = -8),
    ("num_experts_below_topk", &["num_topk"], |s| s.experts = 1),
    ("hidden_zero", &["hidden"], |s| s.hidden = 0),
    ("hidden_neg", &["hidden"], |s| s.hidden = -256),
    ("hidden_12", &["hidden"], |s| s.hidden = 12),
    ("hidden_odd_fp8", &["hidden"], |s| {
        s.hidden = 200;
        s.dtype = FEP_DTYPE_FP8_E4M3
    }),
    ("hidden_odd_fp8_ll", &["hidden"], |s| {
        *s = LOW;
        s.hidden = 200;
        s.dtype = FEP_DTYPE_FP8_E4M3
    }),
    ("num_topk_zero", &["num_topk"], |s| s.topk = 0),
    ("num_topk_9", &["num_topk"], |s| s.topk = 9),
    ("num_topk_neg", &["num_topk"], |s| s.topk = -2),
    ("dispatch_dtype_7", &["dispatch_dtype"], |s| s.dtype = 7),
    ("dispatch_dtype_f32", &["dispatch_dtype"], |s| s.dtype = FEP_DTYPE_F32),
    ("dispatch_dtype_neg", &["dispatch_dtype"], |s| s.dtype = -1),
    ("max_tokens_normal", &["max_tokens_per_rank"], |s| s.maxt = 5),
    ("max_tokens_ll_zero", &["max_tokens_per_rank"], |s| {
        *s = LOW;
        s.maxt = 0
    }),
    ("max_tokens_ll_neg", &["max_tokens_per_rank"], |s| {
        *s = LOW;
        s.maxt = -1
    }),
    ("max_tokens_ll_max", &["max_tokens_per_rank"], |s| {
        *s = LOW;
        s.maxt = i32::MAX
    }),
];

/// Shapes that would allocate without bound.
const SHAPE_HUGE: &[(&str, &[&str], ShpEdit)] = &[
    ("hidden_max", &["hidden"], |s| s.hidden = i32::MAX - 127),
    ("num_experts_max", &["num_experts"], |s| s.experts = i32::MAX),
    ("hidden_max_ll", &["hidden"], |s| {
        *s = LOW;
        s.hidden = i32::MAX - 127
    }),
    ("num_experts_max_ll", &["num_experts"], |s| {
        *s = LOW;
        s.experts = i32::MAX
    }),
];

/// A `fep_allgather_fn` for rank 0 of 2 whose peer reports another `num_rdma_bytes` in
/// `fep_ep_create`'s settings exchange (56 bytes: seven int64, the second `num_rdma_bytes`).
unsafe extern "C" fn lying_peer_gather(
    send: *const c_void,
    len: usize,
    recv: *mut c_void,
    _u: *mut c_void,
) -> c_int {
    for slot in 0..2 {
        std::ptr::copy_nonoverlapping(send.cast::<u8>(), recv.cast::<u8>().add(slot * len), len);
    }
    if len == 56 {
        *recv.cast::<u8>().add(len + 8) ^= 0x10;
    }
    0
}

fn ep_cases(c: &mut Vec<Case>) {
    case(c, "fep_ep_config_init/null", Want::Refuse(&["cfg"]), || {
        got(unsafe { fep_ep_config_init(null_mut()) })
    });
    for &(name, args, in_need, edit) in EP_CONFIG_EDITS {
        case(c, format!("fep_ep_create/{name}"), Want::Refuse(args), move || {
            let mut cfg = ep_config();
            edit(&mut cfg);
            let (st, ep) = ep_create(&cfg);
            if !ep.is_null() && st != FEP_OK {
                return Got { st: FEP_ERR_INTERNAL as i32, msg: "an error with an object".into() };
            }
            got(st)
        });
        if in_need {
            case(c, format!("fep_ep_need_bytes/{name}"), Want::Refuse(args), move || {
                let mut cfg = ep_config();
                edit(&mut cfg);
                got(need_of(&cfg, 1, NORMAL).0)
            });
        }
    }
    for &(name, args, edit) in EP_CONFIG_HUGE {
        case(c, format!("fep_ep_buffer/{name}"), Want::Bounded(args), move || {
            let mut cfg = ep_config();
            edit(&mut cfg);
            let (st, ep) = ep_create(&cfg);
            if st != FEP_OK {
                return got(st);
            }
            got(ep_buffer_of(ep, NORMAL).0)
        });
        case(c, format!("fep_ep_need_bytes/{name}"), Want::Bounded(args), move || {
            let mut cfg = ep_config();
            edit(&mut cfg);
            got(need_of(&cfg, 1, NORMAL).0)
        });
    }
    for &(name, args, edit) in SHAPE_EDITS {
        case(c, format!("fep_ep_buffer/{name}"), Want::Refuse(args), move || {
            let mut s = NORMAL;
            edit(&mut s);
            let ep = live_ep();
            let (st, b) = ep_buffer_of(ep, s);
            if !b.is_null() {
                return Got { st: FEP_ERR_INTERNAL as i32, msg: format!("a buffer with {st:?}") };
            }
            got(st)
        });
        case(c, format!("fep_ep_need_bytes/{name}"), Want::Refuse(args), move || {
            let mut s = NORMAL;
            edit(&mut s);
            got(need_of(&ep_config(), 1, s).0)
        });
    }
    for &(name, args, edit) in SHAPE_HUGE {
        case(c, format!("fep_ep_buffer/{name}"), Want::Bounded(args), move || {
            let mut s = NORMAL;
            edit(&mut s);
            got(ep_buffer_of(live_ep(), s).0)
        });
        case(c, format!("fep_ep_need_bytes/{name}"), Want::Bounded(args), move || {
            let mut s = NORMAL;
            edit(&mut s);
            got(need_of(&ep_config(), 1, s).0)
        });
    }
    let provider = |name: &str, bytes: Vec<u8>| {
        let name = format!("fep_ep_create/provider_{name}");
        (name, move || {
            let s = CString::new(bytes.clone()).unwrap();
            let mut cfg = ep_config();
            cfg.provider = s.as_ptr();
            got(ep_create(&cfg).0)
        })
    };
    for (name, bytes) in [
        ("empty", b"".to_vec()),
        ("blank", b" \t ".to_vec()),
        ("non_utf8", vec![0xff, 0xfe, b's']),
        ("oversized", vec![b's'; 1 << 20]),
        ("control", b"sh\x07m".to_vec()),
    ] {
        let (n, f) = provider(name, bytes);
        case(c, n, Want::Refuse(&["provider"]), f);
    }
    case(c, "fep_ep_create/provider_copied", Want::Accept, || {
        // The provider string need only live for the create call.
        let s = CString::new("shm").unwrap();
        let mut cfg = ep_config();
        cfg.provider = s.as_ptr();
        let ep = ep_with(&cfg);
        drop(s);
        got(ep_buffer_of(ep, NORMAL).0)
    });
    case(c, "fep_ep_create/out_null", Want::Refuse(&["out"]), || {
        got(unsafe { fep_ep_create(&ep_config(), Some(copy_gather), null_mut(), null_mut()) })
    });
    case(c, "fep_ep_create/cfg_null", Want::Refuse(&["cfg"]), || {
        let mut ep = null_mut();
        got(unsafe { fep_ep_create(null(), Some(copy_gather), null_mut(), &mut ep) })
    });
    case(
        c,
        "fep_ep_create/allgather_fails",
        Want::Fail(FEP_ERR_BOOTSTRAP, &["all-gather"]),
        || {
            let mut ep = null_mut();
            got(unsafe { fep_ep_create(&ep_config(), Some(failing_gather), null_mut(), &mut ep) })
        },
    );
    case(
        c,
        "fep_ep_create/peer_disagrees",
        Want::Fail(FEP_ERR_CONFIG_MISMATCH, &["num_rdma_bytes"]),
        || {
            let mut cfg = ep_config();
            (cfg.num_ranks, cfg.ranks_per_node) = (2, 2);
            cfg.num_rdma_bytes = 1 << 20;
            let mut ep = null_mut();
            got(unsafe { fep_ep_create(&cfg, Some(lying_peer_gather), null_mut(), &mut ep) })
        },
    );
    case(c, "fep_ep_create/rank_from_missing_env", Want::Refuse(&["RANK"]), || {
        std::env::remove_var("RANK");
        let mut cfg = ep_config();
        cfg.rank = -1;
        got(ep_create(&cfg).0)
    });
    case(c, "fep_ep_create/valid", Want::Accept, || {
        let (st, ep) = ep_create(&ep_config());
        if st != FEP_OK {
            return got(st);
        }
        got(unsafe { fep_ep_destroy(ep) })
    });
    case(c, "fep_ep_create/env_store", Want::Accept, || {
        // The environment's store, joined once by the object (rank fields from it).
        boot_env();
        let mut cfg = ep_config();
        (cfg.rank, cfg.num_ranks, cfg.ranks_per_node, cfg.local_rank) = (-1, -1, 0, -1);
        let mut ep = null_mut();
        setup(unsafe { fep_ep_create(&cfg, None, null_mut(), &mut ep) }, "fep_ep_create");
        let (b1, b2) = (ep_buffer(ep, NORMAL), ep_buffer(ep, LOW));
        let (mut r, mut n, mut nb) = (-1, -1, -1);
        setup(
            unsafe { fep_ep_info(ep, &mut r, &mut n, null_mut(), &mut nb, null_mut()) },
            "fep_ep_info",
        );
        if (r, n, nb) != (0, 1, 2) || b1 == b2 {
            return Got { st: FEP_ERR_INTERNAL as i32, msg: format!("rank {r}/{n}, {nb} buffers") };
        }
        got(unsafe { fep_ep_destroy(ep) })
    });
    case(c, "fep_ep_create/env_store_rank_disagrees", Want::Refuse(&["rank"]), || {
        boot_env();
        let mut cfg = ep_config();
        // Consistent in itself, not with the store's world of one rank.
        (cfg.rank, cfg.num_ranks, cfg.ranks_per_node) = (1, 2, 2);
        let mut ep = null_mut();
        got(unsafe { fep_ep_create(&cfg, None, null_mut(), &mut ep) })
    });
    // fep_ep_buffer
    case(c, "fep_ep_buffer/ep_null", Want::Refuse(&["ep"]), || {
        got(ep_buffer_of(null_mut(), NORMAL).0)
    });
    case(c, "fep_ep_buffer/ep_foreign", Want::Refuse(&["ep"]), || {
        got(ep_buffer_of(0x9000usize as *mut fep_ep, NORMAL).0)
    });
    case(c, "fep_ep_buffer/ep_destroyed", Want::Refuse(&["ep"]), || {
        got(ep_buffer_of(destroyed_ep(), NORMAL).0)
    });
    case(c, "fep_ep_buffer/ep_is_a_buffer", Want::Refuse(&["ep"]), || {
        got(ep_buffer_of(buffer().cast(), NORMAL).0)
    });
    case(c, "fep_ep_buffer/out_null", Want::Refuse(&["out"]), || {
        let s = NORMAL;
        got(unsafe {
            fep_ep_buffer(live_ep(), s.mode, s.experts, s.hidden, s.topk, s.dtype, 0, null_mut())
        })
    });
    case(c, "fep_ep_buffer/ll_without_low_latency_mode", Want::Refuse(&["mode"]), || {
        let mut cfg = ep_config();
        cfg.low_latency_mode = 0;
        got(ep_buffer_of(ep_with(&cfg), LOW).0)
    });
    case(
        c,
        "fep_ep_buffer/normal_over_capacity",
        Want::Refuse(&["num_nvl_bytes + num_rdma_bytes"]),
        || {
            let mut cfg = ep_config();
            let n = need(&cfg, NORMAL);
            (cfg.num_nvl_bytes, cfg.num_rdma_bytes) = (n as i64 / 2, n as i64 / 2 - 1);
            let (st, b) = ep_buffer_of(ep_with(&cfg), NORMAL);
            let msg = last_error();
            if st != FEP_OK && !msg.contains(&n.to_string()) {
                return Got { st: FEP_ERR_INTERNAL as i32, msg: format!("no need in {msg}") };
            }
            if !b.is_null() {
                return Got { st: FEP_ERR_INTERNAL as i32, msg: "a buffer with the error".into() };
            }
            Got { st: st as i32, msg }
        },
    );
    case(c, "fep_ep_buffer/ll_over_capacity", Want::Refuse(&["num_rdma_bytes"]), || {
        let mut cfg = ep_config();
        // num_nvl_bytes does not count for low latency.
        (cfg.num_nvl_bytes, cfg.num_rdma_bytes) = (1 << 40, need(&cfg, LOW) as i64 - 1);
        got(ep_buffer_of(ep_with(&cfg), LOW).0)
    });
    case(c, "fep_ep_buffer/exact_capacity", Want::Accept, || {
        let mut cfg = ep_config();
        let (n, l) = (need(&cfg, NORMAL), need(&cfg, LOW));
        (cfg.num_nvl_bytes, cfg.num_rdma_bytes) = (n as i64, 0);
        let st = ep_buffer_of(ep_with(&cfg), NORMAL).0;
        if st != FEP_OK {
            return got(st);
        }
        (cfg.num_nvl_bytes, cfg.num_rdma_bytes) = (0, l as i64);
        got(ep_buffer_of(ep_with(&cfg), LOW).0)
    });
    case(c, "fep_ep_buffer/no_limit", Want::Accept, || {
        // 0 and 0: any shape.
        got(ep_buffer_of(live_ep(), Shp { hidden: 8192, ..NORMAL }).0)
    });
    case(c, "fep_ep_buffer/ll_rdma_zero_no_limit", Want::Accept, || {
        let mut cfg = ep_config();
        cfg.num_nvl_bytes = 4096;
        got(ep_buffer_of(ep_with(&cfg), LOW).0)
    });
    case(c, "fep_ep_buffer/reused", Want::Accept, || {
        let ep = live_ep();
        let b = ep_buffer(ep, NORMAL);
        let fp8 = ep_buffer(ep, Shp { dtype: FEP_DTYPE_FP8_E4M3, ..NORMAL });
        let ll = ep_buffer(ep, LOW);
        let ll8 = ep_buffer(ep, Shp { dtype: FEP_DTYPE_FP8_E4M3, ..LOW });
        let again = ep_buffer(ep, NORMAL);
        let mut n = 0;
        setup(
            unsafe { fep_ep_info(ep, null_mut(), null_mut(), null_mut(), &mut n, null_mut()) },
            "fep_ep_info",
        );
        // Host backend: one low-latency buffer for both formats.
        if again != b || fp8 == b || ll == b || ll8 != ll || n != 3 {
            return Got { st: FEP_ERR_INTERNAL as i32, msg: format!("{n} buffers") };
        }
        got(FEP_OK)
    });
    case(c, "fep_ep_buffer/runs_dispatch", Want::Accept, || {
        let b = ep_buffer(live_ep(), NORMAL);
        let (h, rows) = dispatched(b, 4, false);
        let op = ll_dispatched(ep_buffer(live_ep(), LOW), 4, true);
        if rows < 4 || op.is_null() {
            return Got { st: FEP_ERR_INTERNAL as i32, msg: format!("{rows} rows") };
        }
        got_void(|| unsafe { fep_handle_destroy(h) })
    });
    // fep_ep_need_bytes
    for (name, n) in [("zero", 0), ("neg", -1), ("min", i32::MIN), ("over_max", (1 << 20) + 1)] {
        case(
            c,
            format!("fep_ep_need_bytes/world_{name}"),
            Want::Refuse(&["num_ranks"]),
            move || got(need_of(&ep_config(), n, NORMAL).0),
        );
    }
    case(c, "fep_ep_need_bytes/num_experts_not_multiple", Want::Refuse(&["num_experts"]), || {
        got(need_of(&ep_config(), 3, NORMAL).0)
    });
    case(c, "fep_ep_need_bytes/cfg_null", Want::Refuse(&["cfg"]), || {
        let mut n = 0u64;
        let s = NORMAL;
        got(unsafe {
            fep_ep_need_bytes(null(), 1, s.mode, s.experts, s.hidden, s.topk, s.dtype, 0, &mut n)
        })
    });
    case(c, "fep_ep_need_bytes/bytes_null", Want::Refuse(&["bytes"]), || {
        let s = NORMAL;
        got(unsafe {
            fep_ep_need_bytes(
                &ep_config(),
                1,
                s.mode,
                s.experts,
                s.hidden,
                s.topk,
                s.dtype,
                0,
                null_mut(),
            )
        })
    });
    case(c, "fep_ep_need_bytes/valid", Want::Accept, || {
        let cfg = ep_config();
        let (n, l) = (need(&cfg, NORMAL), need(&cfg, LOW));
        let (_, big) = need_of(&cfg, 1, Shp { hidden: 2 * H as i32, ..NORMAL });
        if n == 0 || l == 0 || big <= n {
            return Got { st: FEP_ERR_INTERNAL as i32, msg: format!("needs {n} {l} {big}") };
        }
        got(FEP_OK)
    });
    case(c, "fep_ep_need_bytes/world_of_256", Want::Accept, || {
        // Larger than any world in these tests; the rank fields of cfg are not used.
        let (st, n) = need_of(&ep_config(), 256, Shp { experts: 256, ..NORMAL });
        if st == FEP_OK && n == 0 {
            return Got { st: FEP_ERR_INTERNAL as i32, msg: "0 bytes".into() };
        }
        got(st)
    });
    // fep_ep_info
    let info = |ep: *const fep_ep| {
        let mut r = 0;
        got(unsafe { fep_ep_info(ep, &mut r, null_mut(), null_mut(), null_mut(), null_mut()) })
    };
    case(c, "fep_ep_info/null", Want::Refuse(&["ep"]), move || info(null()));
    case(c, "fep_ep_info/foreign", Want::Refuse(&["ep"]), move || info(0x9000usize as *const _));
    case(c, "fep_ep_info/destroyed", Want::Refuse(&["ep"]), move || info(destroyed_ep()));
    case(c, "fep_ep_info/outputs_null", Want::Accept, || {
        got(unsafe {
            fep_ep_info(live_ep(), null_mut(), null_mut(), null_mut(), null_mut(), null_mut())
        })
    });
    // Lifetimes
    case(c, "fep_ep_destroy/twice", Want::Refuse(&["ep"]), || {
        got(unsafe { fep_ep_destroy(destroyed_ep()) })
    });
    case(c, "fep_ep_destroy/foreign", Want::Refuse(&["ep"]), || {
        got(unsafe { fep_ep_destroy(0x9000usize as *mut fep_ep) })
    });
    case(c, "fep_ep_destroy/a_buffer", Want::Refuse(&["ep"]), || {
        got(unsafe { fep_ep_destroy(buffer().cast()) })
    });
    case(c, "fep_ep_destroy/null", Want::Accept, || got(unsafe { fep_ep_destroy(null_mut()) }));
    case(c, "fep_ep_destroy/with_buffers", Want::Accept, || {
        let ep = live_ep();
        ep_buffer(ep, NORMAL);
        ep_buffer(ep, LOW);
        got(unsafe { fep_ep_destroy(ep) })
    });
    case(c, "fep_ep_destroy/handle_outlives", Want::Accept, || {
        let ep = live_ep();
        let (h, _) = dispatched(ep_buffer(ep, NORMAL), 4, false);
        let op = ll_dispatched(ep_buffer(ep, LOW), 4, false);
        setup(unsafe { fep_ep_destroy(ep) }, "fep_ep_destroy");
        let g = got_void(|| unsafe { fep_handle_destroy(h) });
        if g.st != 0 {
            return g;
        }
        got_void(|| unsafe { fep_ll_op_destroy(op) })
    });
    case(c, "fep_buffer_destroy/owned_by_ep", Want::Refuse(&["fep_ep"]), || {
        let b = ep_buffer(live_ep(), NORMAL);
        let g = got(unsafe { fep_buffer_destroy(b) });
        // Refused, and still usable.
        if g.st != 0 && unsafe { fep_buffer_rank(b, null_mut(), null_mut()) } != FEP_OK {
            return Got { st: FEP_ERR_INTERNAL as i32, msg: "unusable after the refusal".into() };
        }
        g
    });
    case(c, "fep_dispatch/buffer_of_destroyed_ep", Want::Refuse(&["buf"]), || {
        let ep = live_ep();
        let b = ep_buffer(ep, NORMAL);
        setup(unsafe { fep_ep_destroy(ep) }, "fep_ep_destroy");
        let (x, i, w) = (x_bf16(4), idx(4), weights(4));
        let (mut h, mut rows) = (null_mut(), 0i64);
        got(unsafe {
            fep_dispatch(b, &x.t, null(), &i.t, &w.t, null(), 1, 0, null_mut(), &mut h, &mut rows)
        })
    });
    case(c, "fep_low_latency_dispatch/buffer_of_destroyed_ep", Want::Refuse(&["buf"]), || {
        let ep = live_ep();
        let b = ep_buffer(ep, LOW);
        setup(unsafe { fep_ep_destroy(ep) }, "fep_ep_destroy");
        let (x, i) = (x_bf16(4), idx(4));
        let mut op = null_mut();
        got(unsafe {
            fep_low_latency_dispatch(b, &x.t, &i.t, false, false, false, null_mut(), &mut op)
        })
    });
}

// ---------------------------------------------------------------------------------------------
// The runner
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Clean,
    Valid,
    Silent,
    Crash,
    Hang,
    Unnamed,
    OverRefused,
    Setup,
}

fn judge(want: Want, out: &str, exited: Option<i32>, hung: bool) -> (Verdict, String) {
    if hung {
        return (Verdict::Hang, format!("no answer within {DEADLINE:?}"));
    }
    if let Some(l) = out.lines().find(|l| l.contains(SETUP_TAG)) {
        return (Verdict::Setup, l.to_string());
    }
    let Some(line) = out.lines().find_map(|l| l.split_once(RESULT_TAG).map(|(_, r)| r)) else {
        let tail: String = out.lines().rev().take(6).collect::<Vec<_>>().join(" | ");
        return (Verdict::Crash, format!("exit {exited:?}, no result: {tail}"));
    };
    let (st, msg) = line.split_once(' ').unwrap_or((line, ""));
    let st: i32 = st.parse().unwrap_or(-1);
    let names = |args: &[&str]| args.iter().any(|a| msg.contains(a));
    let detail = format!("status {st}: {}", msg.chars().take(300).collect::<String>());
    let v = match want {
        Want::Accept if st == 0 => Verdict::Valid,
        Want::Accept => Verdict::OverRefused,
        _ if st == FEP_ERR_PANIC as i32 => Verdict::Crash,
        Want::Refuse(_) | Want::Fail(..) if st == 0 => Verdict::Silent,
        Want::Bounded(_) if st == 0 => Verdict::Valid,
        Want::Refuse(a) if st == FEP_ERR_INVALID_ARGUMENT as i32 && names(a) => Verdict::Clean,
        Want::Fail(s, a) if st == s as i32 && names(a) => Verdict::Clean,
        Want::Bounded(a) if names(a) => Verdict::Clean,
        _ => Verdict::Unnamed,
    };
    (v, detail)
}

fn run_child(name: &str) -> (String, Option<i32>, bool) {
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args(["c_abi_bad_input_matrix", "--exact", "--nocapture", "--test-threads=1"])
        .env(CASE_VAR, name)
        // A crashing child's core or backtrace files land outside the checkout.
        .current_dir(std::env::temp_dir())
        .env("RUST_BACKTRACE", "0")
        .env_remove("FI_PROVIDER")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn a child");
    // Drain both pipes on threads so a chatty child cannot block on a full pipe.
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t1 = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let t2 = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let (code, hung) = loop {
        match child.try_wait().expect("wait") {
            Some(st) => break (st.code(), false),
            None if start.elapsed() > DEADLINE => {
                let _ = child.kill();
                let _ = child.wait();
                break (None, true);
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    let out = t1.join().unwrap_or_default() + &t2.join().unwrap_or_default();
    remove_shm_regions(child.id());
    (out, code, hung)
}

/// libfabric's shm provider names its regions `/dev/shm/<pid>:<n>:<m>`; a child that exits
/// without closing its endpoints (every case here ends with `process::exit`, or is killed)
/// leaves them behind, 16 MiB each: the dead child's are removed.
fn remove_shm_regions(pid: u32) {
    let prefix = format!("{pid}:");
    if let Ok(dir) = std::fs::read_dir("/dev/shm") {
        for e in dir.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

#[test]
fn c_abi_bad_input_matrix() {
    let all = cases();
    if let Ok(name) = std::env::var(CASE_VAR) {
        let c = all.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no case {name}"));
        let g = (c.run)();
        let msg = g.msg.replace('\n', " ");
        let mut o = std::io::stdout();
        let _ = writeln!(o, "\n{RESULT_TAG}{} {msg}", g.st);
        let _ = o.flush();
        // Exit now: no destructor of a fixture may change the verdict.
        std::process::exit(0);
    }
    let mut names = std::collections::HashSet::new();
    for c in &all {
        assert!(names.insert(c.name.clone()), "case {} twice", c.name);
    }
    let only = std::env::var("FEP_BAD_INPUT_ONLY").unwrap_or_default();
    let sel: Vec<&Case> = all.iter().filter(|c| c.name.contains(&only)).collect();
    let jobs: usize =
        std::env::var("FEP_BAD_INPUT_JOBS").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
    let next = AtomicUsize::new(0);
    let results = Mutex::new(Vec::new());
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(c) = sel.get(i) else { break };
                let (out, code, hung) = run_child(&c.name);
                let (v, detail) = judge(c.want, &out, code, hung);
                results.lock().unwrap().push((c.name.clone(), v, detail));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    // A case past its deadline while 8 children share a loaded 2-core machine is run again,
    // alone: only a case that hangs alone too counts as a hang (the retries are printed).
    let mut retried = 0;
    for r in results.iter_mut().filter(|r| r.1 == Verdict::Hang) {
        let c = sel.iter().find(|c| c.name == r.0).expect("a selected case");
        let (out, code, hung) = run_child(&c.name);
        let (v, detail) = judge(c.want, &out, code, hung);
        eprintln!("re-ran {} alone after its deadline in the parallel pass: {v:?}", r.0);
        retried += 1;
        (r.1, r.2) = (v, detail);
    }
    results.sort_by(|a, b| a.0.cmp(&b.0));
    let count = |v: Verdict| results.iter().filter(|r| r.1 == v).count();
    let bad: Vec<_> =
        results.iter().filter(|r| !matches!(r.1, Verdict::Clean | Verdict::Valid)).collect();
    for (name, v, detail) in &bad {
        eprintln!("FAULT {v:?} {name}: {detail}");
    }
    println!(
        "bad-input: {} cases, {} clean, {} silent, {} crashes, {} hangs; {} unnamed, {} valid accepted, {} valid refused, {} set-up failures ({:.1} s; {retried} re-run alone after a deadline)",
        results.len(),
        count(Verdict::Clean),
        count(Verdict::Silent),
        count(Verdict::Crash),
        count(Verdict::Hang),
        count(Verdict::Unnamed),
        count(Verdict::Valid),
        count(Verdict::OverRefused),
        count(Verdict::Setup),
        start.elapsed().as_secs_f64()
    );
    if only.is_empty() {
        assert!(results.len() >= 250, "only {} cases", results.len());
    }
    assert!(
        bad.is_empty(),
        "{} of {} cases did not end cleanly (FAULT lines above)",
        bad.len(),
        results.len()
    );
}
