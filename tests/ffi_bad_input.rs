//! Bad input through the exported C ABI: every case must come back as `FEP_ERR_INVALID_ARGUMENT`
//! with a message naming the argument, never a crash, a hang or a silent accept; objects used
//! after their destroy (or destroyed twice) are refused. World-1 buffers over a caller
//! all-gather (a copy), so the cases need no environment and run in parallel.

use std::ffi::{c_void, CStr, CString};
use std::os::raw::c_int;
use std::ptr::{null, null_mut};

use fabric_ep::ffi::*;

unsafe extern "C" fn copy_gather(
    send: *const c_void,
    len: usize,
    recv: *mut c_void,
    _u: *mut c_void,
) -> c_int {
    std::ptr::copy_nonoverlapping(send.cast::<u8>(), recv.cast::<u8>(), len);
    0
}

fn last_error() -> String {
    unsafe { CStr::from_ptr(fep_last_error()) }.to_string_lossy().into_owned()
}

fn config() -> fep_config {
    let mut c = std::mem::MaybeUninit::<fep_config>::uninit();
    unsafe {
        assert_eq!(fep_config_init(c.as_mut_ptr()), fep_status::FEP_OK);
        let mut c = c.assume_init();
        c.rank = 0;
        c.num_ranks = 1;
        c.ranks_per_node = 1;
        c.local_rank = 0;
        c.num_experts = 8;
        c.hidden = 256;
        c.num_topk = 2;
        c.timeout_s = 10.0;
        c
    }
}

fn create(c: &fep_config) -> (fep_status, *mut fep_buffer) {
    let mut b = null_mut();
    let st = unsafe { fep_buffer_create(c, Some(copy_gather), null_mut(), &mut b) };
    (st, b)
}

fn refused(st: fep_status, arg: &str) {
    assert_eq!(
        st,
        fep_status::FEP_ERR_INVALID_ARGUMENT,
        "accepted; expected a refusal naming {arg}"
    );
    let msg = last_error();
    assert!(msg.contains(arg), "the message {msg:?} does not name {arg}");
}

#[test]
fn config_fields_out_of_range_are_refused() {
    type Edit = fn(&mut fep_config);
    let cases: &[(&str, Edit)] = &[
        ("timeout_s", |c| c.timeout_s = f64::NAN),
        ("timeout_s", |c| c.timeout_s = -1.0),
        ("timeout_s", |c| c.timeout_s = f64::INFINITY),
        ("num_sms", |c| c.num_sms = -2),
        ("chunk_tokens", |c| c.chunk_tokens = -1),
        ("slots_per_peer", |c| c.slots_per_peer = -3),
        ("max_tokens_per_rank", |c| c.max_tokens_per_rank = -1),
        ("ranks_per_node", |c| c.ranks_per_node = -1),
        ("local_rank", |c| c.local_rank = -5),
        ("rank", |c| c.rank = -7),
        ("num_ranks", |c| c.num_ranks = -2),
        ("device", |c| c.device = -2),
        ("gpu_reserve_tokens", |c| c.gpu_reserve_tokens = -2),
        ("internode_hierarchy", |c| c.internode_hierarchy = 2),
        ("modes", |c| c.modes = 4),
        ("num_experts", |c| c.num_experts = 0),
        ("hidden", |c| c.hidden = -256),
        ("num_topk", |c| c.num_topk = 9),
        ("dispatch_dtype", |c| c.dispatch_dtype = 7),
        ("backend", |c| c.backend = 5),
        ("cfg", |c| c.struct_size = 81),
        ("cfg", |c| c.struct_size = 4096),
        ("cfg", |c| c.struct_size = 8),
        ("cfg", |c| c.version = 99),
    ];
    for (arg, edit) in cases {
        let mut c = config();
        edit(&mut c);
        let (st, b) = create(&c);
        assert!(b.is_null());
        refused(st, arg);
        let mut h = fep_size_hints::default();
        refused(unsafe { fep_get_size_hints(&c, &mut h) }, arg);
    }
    let empty = CString::new("").unwrap();
    let mut c = config();
    c.provider = empty.as_ptr();
    refused(create(&c).0, "provider");
}

#[test]
fn destroyed_objects_are_refused() {
    let (st, b) = create(&config());
    assert_eq!(st, fep_status::FEP_OK, "{}", last_error());
    let mut r = 0;
    let mut n = 0;
    assert_eq!(unsafe { fep_buffer_rank(b, &mut r, &mut n) }, fep_status::FEP_OK);
    // A dispatch of 4 tokens, top-2.
    let x = vec![0u16; 4 * 256];
    let idx: Vec<i64> = vec![0, 1, 2, 3, 4, 5, 6, 7];
    let w = [1f32; 8];
    let t = |p: *const c_void, d: i32, s0: i64, s1: i64| fep_tensor {
        data: p.cast_mut(),
        dtype: d,
        ndim: 2,
        shape: [s0, s1, 0, 0],
    };
    let (tx, ti, tw) = (
        t(x.as_ptr().cast(), FEP_DTYPE_BF16, 4, 256),
        t(idx.as_ptr().cast(), FEP_DTYPE_I64, 4, 2),
        t(w.as_ptr().cast(), FEP_DTYPE_F32, 4, 2),
    );
    let mut h = null_mut();
    let mut rows = 0i64;
    let dispatch = |nwt: i64,
                    cached: *const fep_handle,
                    idx: *const fep_tensor,
                    h: &mut *mut fep_handle,
                    rows: &mut i64| unsafe {
        fep_dispatch(
            b,
            &tx,
            null(),
            idx,
            if idx.is_null() { null() } else { &tw },
            cached,
            1,
            nwt,
            null_mut(),
            h,
            rows,
        )
    };
    refused(dispatch(-1, null(), &ti, &mut h, &mut rows), "num_worst_tokens");
    refused(dispatch(1 << 40, null(), &ti, &mut h, &mut rows), "num_worst_tokens");
    assert_eq!(dispatch(0, null(), &ti, &mut h, &mut rows), fep_status::FEP_OK, "{}", last_error());
    assert_eq!(rows, 4);
    let mut h2 = null_mut();
    refused(dispatch(0, h, &ti, &mut h2, &mut rows), "topk_idx/topk_weights");
    // A stale or foreign handle pointer.
    let fake = 0x1000usize as *const fep_handle;
    refused(dispatch(0, fake, null(), &mut h2, &mut rows), "cached");
    assert_eq!(unsafe { fep_handle_num_recv_tokens(fake) }, -1);
    unsafe { fep_handle_destroy(h) };
    unsafe { fep_handle_destroy(h) }; // a second destroy: reported, not a double free
    assert!(last_error().contains("handle"), "{}", last_error());
    refused(dispatch(0, h, null(), &mut h2, &mut rows), "cached");
    // The buffer: destroy, then every use and a second destroy are refused.
    assert_eq!(unsafe { fep_buffer_destroy(b) }, fep_status::FEP_OK);
    refused(unsafe { fep_buffer_destroy(b) }, "buf");
    refused(unsafe { fep_buffer_rank(b, &mut r, &mut n) }, "buf");
    refused(dispatch(0, null(), &ti, &mut h2, &mut rows), "buf");
    refused(unsafe { fep_clean_low_latency_buffer(b) }, "buf");
    // Low-latency ops: a foreign pointer and a double destroy.
    let op = 0x2000usize as *mut fep_ll_op;
    unsafe { fep_ll_op_destroy(op) };
    assert!(last_error().contains("op"));
    // A bootstrap that was never created.
    let boot = 0x3000usize as *mut fep_boot;
    refused(unsafe { fep_boot_destroy(boot) }, "boot");
    let mut rr = 0;
    refused(unsafe { fep_boot_rank(boot, &mut rr, null_mut(), null_mut(), null_mut()) }, "boot");
}
