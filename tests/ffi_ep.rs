//! `fep_ep` (DeepEP's per-call shape in the C ABI) through the exported symbols, ranks as OS
//! processes (this test binary re-executed, one per rank) on the host backend, bootstrapped
//! through a caller's all-gather callback (`fep_boot_allgather` over a `fep_boot` each rank
//! joined from the environment). One object per rank, sized with `fep_ep_need_bytes` for its
//! shapes, serves two normal shapes (hidden 256 bf16, then hidden 384 fp8) and a low-latency
//! one (the host casts per call: bf16, then fp8 through the receive hook, on one buffer); every
//! output is compared with the reference (src/protocol/reference.rs, through ep_bench::ep's inputs
//! and reference runs of every rank's inputs). The first shape asked again is the same buffer and
//! still correct; shapes over the capacity are refused naming the argument and both sizes; the
//! object's buffers are refused by `fep_buffer_destroy` and stale after `fep_ep_destroy`.
//!
//! A GPU case (ignored without `--include-ignored`, skipped without a GPU) checks that one
//! object's buffers report one communication stream.

use std::ffi::{c_void, CStr};
use std::io::Read;
use std::os::raw::c_int;
use std::process::{Command, Stdio};
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

use ep_bench::ep::{
    combine_input, ll_combine_input, ll_rank_inputs, ll_reference_rank, rank_inputs, reference,
    LlBenchParams, NormalBenchParams,
};
use fabric_ep::ffi::*;
use fabric_ep::protocol::config::{DispatchDtype, EpConfig, EpSettings};
use fabric_ep::protocol::reference::Tokens;

const ROLE: &str = "FEP_EP_TEST_RANK";
const WORLD: usize = 3;
const E: i32 = 12;
const K: i32 = 3;
const H1: i32 = 256;
const H2: i32 = 384;
const MAXT: i32 = 16;
const TOKENS: usize = 40;
const DEADLINE: Duration = Duration::from_secs(180);

fn last_error() -> String {
    unsafe { CStr::from_ptr(fep_last_error()) }.to_string_lossy().into_owned()
}

type R<T = ()> = Result<T, String>;

fn ok(what: &str, st: fep_status) -> R {
    if st == FEP_OK {
        Ok(())
    } else {
        Err(format!("{what}: {st:?}: {}", last_error()))
    }
}

fn ensure(cond: bool, what: impl FnOnce() -> String) -> R {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

fn tensor<T>(v: &mut [T], dtype: i32, shape: &[usize]) -> fep_tensor {
    let mut s = [0i64; 4];
    for (d, x) in s.iter_mut().zip(shape) {
        *d = *x as i64;
    }
    fep_tensor { data: v.as_mut_ptr().cast(), dtype, ndim: shape.len() as i32, shape: s }
}

fn ep_config() -> fep_ep_config {
    let mut c = std::mem::MaybeUninit::<fep_ep_config>::uninit();
    unsafe {
        assert_eq!(fep_ep_config_init(c.as_mut_ptr()), FEP_OK);
        let mut c = c.assume_init();
        c.low_latency_mode = 1;
        c.timeout_s = 30.0;
        c.provider = c"shm".as_ptr();
        c
    }
}

fn need(cfg: &fep_ep_config, mode: i32, hidden: i32, dtype: i32, maxt: i32) -> R<u64> {
    let mut b = 0u64;
    ok("fep_ep_need_bytes", unsafe {
        fep_ep_need_bytes(cfg, WORLD as i32, mode, E, hidden, K, dtype, maxt, &mut b)
    })?;
    Ok(b)
}

/// The size hints of a one-shape `fep_config` (what `fep_ep_need_bytes` must agree with).
fn size_hints(hidden: i32, dtype: i32, maxt: i32) -> R<fep_size_hints> {
    let mut c = std::mem::MaybeUninit::<fep_config>::uninit();
    let mut h = fep_size_hints::default();
    unsafe {
        fep_config_init(c.as_mut_ptr());
        let mut c = c.assume_init();
        (c.rank, c.num_ranks, c.ranks_per_node, c.local_rank) = (0, WORLD as i32, 1, 0);
        (c.num_experts, c.hidden, c.num_topk, c.dispatch_dtype) = (E, hidden, K, dtype);
        c.max_tokens_per_rank = maxt;
        ok("fep_get_size_hints", fep_get_size_hints(&c, &mut h))?;
    }
    Ok(h)
}

fn ep_buffer(ep: *mut fep_ep, mode: i32, hidden: i32, dtype: i32, maxt: i32) -> R<*mut fep_buffer> {
    let mut b = null_mut();
    ok("fep_ep_buffer", unsafe { fep_ep_buffer(ep, mode, E, hidden, K, dtype, maxt, &mut b) })?;
    ensure(!b.is_null(), || "fep_ep_buffer: OK with a NULL buffer".into())?;
    Ok(b)
}

fn num_buffers(ep: *mut fep_ep) -> R<i32> {
    let mut n = -1;
    ok("fep_ep_info", unsafe {
        fep_ep_info(ep, null_mut(), null_mut(), null_mut(), &mut n, null_mut())
    })?;
    Ok(n)
}

fn settings(rank: usize, hidden: i32, fp8: bool, maxt: usize) -> R<EpConfig> {
    let mut s = EpSettings::new(rank, WORLD, E as usize, hidden as usize, K as usize);
    s.ranks_per_node = WORLD;
    s.max_tokens_per_rank = maxt;
    if fp8 {
        s.dispatch_dtype = DispatchDtype::Fp8E4m3;
    }
    EpConfig::new(s).map_err(|e| e.to_string())
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// A normal dispatch + combine of this rank's reference inputs on `b`, every output against the
/// reference of all ranks' inputs.
fn normal_round(b: *mut fep_buffer, rank: usize, hidden: i32, fp8: bool, seed: u64) -> R {
    let what = format!("normal hidden {hidden} fp8 {fp8}");
    let cfg = settings(rank, hidden, fp8, 128)?;
    let p = NormalBenchParams {
        num_tokens: TOKENS,
        seed,
        drop_pct: 10,
        iters: 1,
        warmup: 0,
        combine_weights: true,
        one_way: false,
    };
    let inputs: Vec<_> = (0..WORLD)
        .map(|r| rank_inputs(&cfg, &p, r))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let (d, c) = reference(&cfg, &inputs, 1, None, true).map_err(|e| e.to_string())?;
    let (want, want_c) = (&d[rank], &c[rank]);
    let me = inputs[rank].clone();
    let (h, k, t) = (hidden as usize, K as usize, TOKENS);
    let (mut idx, mut w) = (me.topk_idx.clone(), me.topk_weights.clone());
    let ti = tensor(&mut idx, FEP_DTYPE_I64, &[t, k]);
    let tw = tensor(&mut w, FEP_DTYPE_F32, &[t, k]);
    let (mut handle, mut rows) = (null_mut(), -1i64);
    let mut x_bf16 = me.x_bf16.clone();
    let (mut x8, mut s8) = me.x_fp8.clone().unwrap_or_default();
    let st = unsafe {
        if fp8 {
            let tx = tensor(&mut x8, FEP_DTYPE_FP8_E4M3, &[t, h]);
            let ts = tensor(&mut s8, FEP_DTYPE_F32, &[t, h / 128]);
            fep_dispatch(b, &tx, &ts, &ti, &tw, null(), 1, 0, null_mut(), &mut handle, &mut rows)
        } else {
            let tx = tensor(&mut x_bf16, FEP_DTYPE_BF16, &[t, h]);
            fep_dispatch(b, &tx, null(), &ti, &tw, null(), 1, 0, null_mut(), &mut handle, &mut rows)
        }
    };
    ok(&format!("{what}: fep_dispatch"), st)?;
    let n = rows as usize;
    ensure(n == want.num_recv_tokens, || {
        format!("{what}: {n} rows received, the reference {}", want.num_recv_tokens)
    })?;
    let local = E as usize / WORLD;
    let (mut rx16, mut rx8, mut rsc) =
        (vec![0u16; n * h], vec![0u8; n * h], vec![0f32; n * h / 128]);
    let (mut ridx, mut rw, mut per_expert) =
        (vec![0i64; n * k], vec![0f32; n * k], vec![0i32; local]);
    let mut tri = tensor(&mut ridx, FEP_DTYPE_I64, &[n, k]);
    let mut trw = tensor(&mut rw, FEP_DTYPE_F32, &[n, k]);
    let mut tpe = tensor(&mut per_expert, FEP_DTYPE_I32, &[local]);
    let st = unsafe {
        if fp8 {
            let mut trx = tensor(&mut rx8, FEP_DTYPE_FP8_E4M3, &[n, h]);
            let mut trs = tensor(&mut rsc, FEP_DTYPE_F32, &[n, h / 128]);
            fep_handle_copy_out(handle, &mut trx, &mut trs, &mut tri, &mut trw, &mut tpe)
        } else {
            let mut trx = tensor(&mut rx16, FEP_DTYPE_BF16, &[n, h]);
            fep_handle_copy_out(handle, &mut trx, null_mut(), &mut tri, &mut trw, &mut tpe)
        }
    };
    ok(&format!("{what}: fep_handle_copy_out"), st)?;
    let got_x = if fp8 { Tokens::Fp8 { x: rx8, scales: rsc } } else { Tokens::Bf16(rx16) };
    ensure(got_x == want.recv_x, || format!("{what}: recv_x differs from the reference"))?;
    ensure(ridx == want.recv_topk_idx, || format!("{what}: recv_topk_idx differs"))?;
    ensure(same_bits(&rw, &want.recv_topk_weights), || {
        format!("{what}: recv_topk_weights differ")
    })?;
    let pe: Vec<usize> = per_expert.iter().map(|&v| v as usize).collect();
    ensure(pe == want.num_recv_tokens_per_expert, || {
        format!(
            "{what}: num_recv_tokens_per_expert {pe:?}, the reference {:?}",
            want.num_recv_tokens_per_expert
        )
    })?;
    // Each rank returns what it received (bf16; fp8 rows dequantized), weights too.
    let mut back = combine_input(&got_x, h).map_err(|e| e.to_string())?;
    let tb = tensor(&mut back, FEP_DTYPE_BF16, &[n, h]);
    let trw = tensor(&mut rw, FEP_DTYPE_F32, &[n, k]);
    let (mut cx, mut cw) = (vec![0u16; t * h], vec![0f32; t * k]);
    let mut tcx = tensor(&mut cx, FEP_DTYPE_BF16, &[t, h]);
    let mut tcw = tensor(&mut cw, FEP_DTYPE_F32, &[t, k]);
    let st = unsafe { fep_combine(b, handle, &tb, &trw, &mut tcx, &mut tcw, null_mut()) };
    unsafe { fep_handle_destroy(handle) };
    ok(&format!("{what}: fep_combine"), st)?;
    ensure(cx == want_c.combined_x, || format!("{what}: combined_x differs from the reference"))?;
    let wcw = want_c.combined_topk_weights.as_deref().unwrap_or_default();
    ensure(same_bits(&cw, wcw), || format!("{what}: combined_topk_weights differ"))?;
    Ok(())
}

/// A low-latency dispatch + combine (this rank's reference inputs; `use_fp8` casts on the way;
/// with `hook` the receive runs in `fep_ll_op_complete`) on `b`, against the reference.
fn ll_round(b: *mut fep_buffer, rank: usize, use_fp8: bool, hook: bool, seed: u64) -> R {
    let what = format!("low latency fp8 {use_fp8}");
    let cfg = settings(rank, H1, false, MAXT as usize)?;
    let p = LlBenchParams {
        tokens: vec![MAXT as usize, 9, 0],
        seed,
        drop_pct: 10,
        use_fp8,
        round_scale: false,
        iters: 1,
        warmup: 0,
    };
    let inputs: Vec<_> = (0..WORLD)
        .map(|r| ll_rank_inputs(&cfg, &p, r))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let (want, want_c) =
        ll_reference_rank(&cfg, &inputs, rank, use_fp8, false).map_err(|e| e.to_string())?;
    let me = inputs[rank].clone();
    let (h, k) = (H1 as usize, K as usize);
    let t = me.x.len() / h;
    let (mut x, mut idx, mut w) = (me.x.clone(), me.topk_idx.clone(), me.topk_weights.clone());
    let tx = tensor(&mut x, FEP_DTYPE_BF16, &[t, h]);
    let ti = tensor(&mut idx, FEP_DTYPE_I64, &[t, k]);
    let tw = tensor(&mut w, FEP_DTYPE_F32, &[t, k]);
    let mut op = null_mut();
    ok(&format!("{what}: fep_low_latency_dispatch"), unsafe {
        fep_low_latency_dispatch(b, &tx, &ti, use_fp8, false, hook, null_mut(), &mut op)
    })?;
    if hook {
        ok(&format!("{what}: fep_ll_op_complete"), unsafe { fep_ll_op_complete(b, op) })?;
    }
    let (l, s) = (E as usize / WORLD, WORLD * MAXT as usize);
    let (mut rx16, mut rx8, mut rsc) =
        (vec![0u16; l * s * h], vec![0u8; l * s * h], vec![0f32; l * s * h / 128]);
    let (mut cnt, mut srank, mut sidx, mut range) =
        (vec![0i32; l], vec![0i32; l * s], vec![0i32; l * s], vec![0i64; l * WORLD]);
    let mut tcnt = tensor(&mut cnt, FEP_DTYPE_I32, &[l]);
    let mut tsr = tensor(&mut srank, FEP_DTYPE_I32, &[l, s]);
    let mut tsi = tensor(&mut sidx, FEP_DTYPE_I32, &[l, s]);
    let mut tlr = tensor(&mut range, FEP_DTYPE_I64, &[l, WORLD]);
    let st = unsafe {
        if use_fp8 {
            let mut trx = tensor(&mut rx8, FEP_DTYPE_FP8_E4M3, &[l, s, h]);
            let mut trs = tensor(&mut rsc, FEP_DTYPE_F32, &[l, s, h / 128]);
            fep_ll_dispatch_copy_out(
                op, &mut trx, &mut trs, &mut tcnt, &mut tsr, &mut tsi, &mut tlr,
            )
        } else {
            let mut trx = tensor(&mut rx16, FEP_DTYPE_BF16, &[l, s, h]);
            fep_ll_dispatch_copy_out(
                op,
                &mut trx,
                null_mut(),
                &mut tcnt,
                &mut tsr,
                &mut tsi,
                &mut tlr,
            )
        }
    };
    ok(&format!("{what}: fep_ll_dispatch_copy_out"), st)?;
    let count: Vec<u32> = cnt.iter().map(|&c| c as u32).collect();
    ensure(count == want.recv_count, || {
        format!("{what}: recv_count {count:?}, the reference {:?}", want.recv_count)
    })?;
    let packed: Vec<i64> =
        want.layout_range.iter().map(|&(b, c)| (i64::from(b) << 32) | i64::from(c)).collect();
    ensure(range == packed, || format!("{what}: layout_range differs from the reference"))?;
    let got_x = if use_fp8 { Tokens::Fp8 { x: rx8, scales: rsc } } else { Tokens::Bf16(rx16) };
    let g = h / 128;
    for (e, &c) in count.iter().enumerate() {
        for i in 0..c as usize {
            let o = e * s + i;
            let same = match (&got_x, &want.recv_x) {
                (Tokens::Bf16(a), Tokens::Bf16(b)) => {
                    a[o * h..(o + 1) * h] == b[o * h..(o + 1) * h]
                }
                (Tokens::Fp8 { x: a, scales: sa }, Tokens::Fp8 { x: b, scales: sb }) => {
                    a[o * h..(o + 1) * h] == b[o * h..(o + 1) * h]
                        && same_bits(&sa[o * g..(o + 1) * g], &sb[o * g..(o + 1) * g])
                }
                _ => false,
            };
            ensure(
                same && srank[o] == want.recv_src_rank[o] && sidx[o] == want.recv_src_idx[o],
                || format!("{what}: expert {e} row {i} differs from the reference"),
            )?;
        }
    }
    // Each expert returns the rows it received (fp8 dequantized).
    let mut y = ll_combine_input(&got_x, &count, h).map_err(|e| e.to_string())?;
    let ty = tensor(&mut y, FEP_DTYPE_BF16, &[l, s, h]);
    let mut cop = null_mut();
    let st = unsafe { fep_low_latency_combine(b, op, &ty, &ti, &tw, hook, null_mut(), &mut cop) };
    unsafe { fep_ll_op_destroy(op) };
    ok(&format!("{what}: fep_low_latency_combine"), st)?;
    if hook {
        ok(&format!("{what}: combine's fep_ll_op_complete"), unsafe {
            fep_ll_op_complete(b, cop)
        })?;
    }
    let mut out = vec![0u16; t * h];
    let mut to = tensor(&mut out, FEP_DTYPE_BF16, &[t, h]);
    let st = unsafe { fep_ll_combine_copy_out(cop, &mut to) };
    unsafe { fep_ll_op_destroy(cop) };
    ok(&format!("{what}: fep_ll_combine_copy_out"), st)?;
    ensure(out == want_c, || format!("{what}: combined_x differs from the reference"))
}

/// `fep_ep_buffer` of a shape over the capacity: refused naming `arg`, the capacity and the
/// need, and nothing created.
fn over(ep: *mut fep_ep, mode: i32, hidden: i32, maxt: i32, arg: &str, cap: u64, need: u64) -> R {
    ensure(need > cap, || format!("the test's shape needs {need}, not more than {cap}"))?;
    let before = num_buffers(ep)?;
    let mut b = null_mut();
    let st = unsafe { fep_ep_buffer(ep, mode, E, hidden, K, FEP_DTYPE_BF16, maxt, &mut b) };
    let msg = last_error();
    ensure(st == FEP_ERR_INVALID_ARGUMENT && b.is_null(), || {
        format!("a shape needing {need} of {cap} bytes: {st:?} {msg}")
    })?;
    ensure(
        msg.contains(&format!("`{arg}`"))
            && msg.contains(&cap.to_string())
            && msg.contains(&need.to_string()),
        || format!("the refusal does not name {arg}, {cap} and {need}: {msg}"),
    )?;
    ensure(num_buffers(ep)? == before, || "a refused shape created a buffer".into())
}

fn rank_main(rank: usize) -> R {
    let mut boot = null_mut();
    ok("fep_boot_create", unsafe { fep_boot_create(30.0, &mut boot) })?;
    let mut cfg = ep_config();
    // Sizes: the largest normal shape's need, plus the low-latency shape's.
    let n1 = need(&cfg, FEP_MODE_NORMAL, H1, FEP_DTYPE_BF16, 0)?;
    let n2 = need(&cfg, FEP_MODE_NORMAL, H2, FEP_DTYPE_FP8_E4M3, 0)?;
    let nl = need(&cfg, FEP_MODE_LOW_LATENCY, H1, FEP_DTYPE_BF16, MAXT)?;
    // The size hints' arithmetic (what the Python package sizes with); on the host one
    // low-latency buffer serves both formats, so both need its bf16 bytes.
    ensure(n1 == size_hints(H1, FEP_DTYPE_BF16, 0)?.normal_bytes, || format!("n1 {n1}"))?;
    ensure(n2 == size_hints(H2, FEP_DTYPE_FP8_E4M3, 0)?.normal_bytes, || format!("n2 {n2}"))?;
    ensure(nl == size_hints(H1, FEP_DTYPE_BF16, MAXT)?.ll_bytes, || format!("nl {nl}"))?;
    ensure(need(&cfg, FEP_MODE_LOW_LATENCY, H1, FEP_DTYPE_FP8_E4M3, MAXT)? == nl, || {
        "host low latency: the fp8 shape's need is not the shared buffer's".into()
    })?;
    cfg.num_nvl_bytes = n1.max(n2) as i64;
    cfg.num_rdma_bytes = nl as i64;
    let mut ep = null_mut();
    ok("fep_ep_create", unsafe {
        fep_ep_create(&cfg, Some(fep_boot_allgather), boot.cast(), &mut ep)
    })?;
    let (mut r, mut n, mut rpn, mut nb, mut comm) =
        (-1, -1, -1, -1, std::ptr::dangling_mut::<c_void>());
    ok("fep_ep_info", unsafe { fep_ep_info(ep, &mut r, &mut n, &mut rpn, &mut nb, &mut comm) })?;
    ensure(
        (r, n, rpn, nb) == (rank as i32, WORLD as i32, WORLD as i32, 0) && comm.is_null(),
        || format!("fep_ep_info: rank {r} of {n}, {rpn} per node, {nb} buffers, comm {comm:?}"),
    )?;

    let b1 = ep_buffer(ep, FEP_MODE_NORMAL, H1, FEP_DTYPE_BF16, 0)?;
    normal_round(b1, rank, H1, false, 11)?;
    let b2 = ep_buffer(ep, FEP_MODE_NORMAL, H2, FEP_DTYPE_FP8_E4M3, 0)?;
    ensure(b2 != b1, || "the fp8 shape got the bf16 shape's buffer".into())?;
    normal_round(b2, rank, H2, true, 12)?;
    let b3 = ep_buffer(ep, FEP_MODE_LOW_LATENCY, H1, FEP_DTYPE_BF16, MAXT)?;
    ensure(b3 != b1 && b3 != b2, || "the low-latency shape got a normal shape's buffer".into())?;
    ll_round(b3, rank, false, false, 13)?;
    let b3_fp8 = ep_buffer(ep, FEP_MODE_LOW_LATENCY, H1, FEP_DTYPE_FP8_E4M3, MAXT)?;
    ensure(b3_fp8 == b3, || "host low latency: the fp8 shape got another buffer".into())?;
    ll_round(b3, rank, true, true, 14)?;
    // The first shape again: its buffer, nothing created.
    ensure(ep_buffer(ep, FEP_MODE_NORMAL, H1, FEP_DTYPE_BF16, 0)? == b1, || {
        "the first shape asked again got a new buffer".into()
    })?;
    normal_round(b1, rank, H1, false, 15)?;
    ensure(num_buffers(ep)? == 3, || "three shapes' buffers expected".into())?;

    let cap = cfg.num_nvl_bytes as u64 + cfg.num_rdma_bytes as u64;
    let big = need(&cfg, FEP_MODE_NORMAL, 8192, FEP_DTYPE_BF16, 0)?;
    over(ep, FEP_MODE_NORMAL, 8192, 0, "num_nvl_bytes + num_rdma_bytes", cap, big)?;
    let big_ll = need(&cfg, FEP_MODE_LOW_LATENCY, H1, FEP_DTYPE_BF16, 4 * MAXT)?;
    over(ep, FEP_MODE_LOW_LATENCY, H1, 4 * MAXT, "num_rdma_bytes", nl, big_ll)?;

    // The object owns its buffers.
    let st = unsafe { fep_buffer_destroy(b1) };
    let msg = last_error();
    ensure(
        st == FEP_ERR_INVALID_ARGUMENT && msg.contains("`buf`") && msg.contains("fep_ep"),
        || format!("fep_buffer_destroy of an object's buffer: {st:?} {msg}"),
    )?;
    ok("fep_buffer_rank after a refused destroy", unsafe {
        fep_buffer_rank(b1, null_mut(), null_mut())
    })?;
    ok("fep_ep_destroy", unsafe { fep_ep_destroy(ep) })?;
    for b in [b1, b2, b3] {
        let st = unsafe { fep_buffer_rank(b, null_mut(), null_mut()) };
        ensure(
            st == FEP_ERR_INVALID_ARGUMENT && last_error().contains("not a live object"),
            || format!("a buffer after fep_ep_destroy: {st:?} {}", last_error()),
        )?;
    }
    let st = unsafe { fep_ep_destroy(ep) };
    ensure(st == FEP_ERR_INVALID_ARGUMENT && last_error().contains("`ep`"), || {
        format!("a second fep_ep_destroy: {st:?} {}", last_error())
    })?;
    ok("fep_boot_destroy", unsafe { fep_boot_destroy(boot) })?;
    println!("OK rank {rank}: {nb} -> 3 buffers, needs normal {n1} / {n2}, low latency {nl}");
    Ok(())
}

/// libfabric's shm regions of a finished child (`/dev/shm/<pid>:*`).
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
fn ep_shapes_as_processes_against_the_reference() {
    const TEST: &str = "ep_shapes_as_processes_against_the_reference";
    if let Ok(r) = std::env::var(ROLE) {
        let rank: usize = r.parse().expect("rank");
        if let Err(e) = rank_main(rank) {
            println!("FAIL rank {rank}: {e}");
            std::process::exit(1);
        }
        std::process::exit(0);
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut kids = Vec::new();
    for r in 0..WORLD {
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "--nocapture", "--test-threads=1", TEST])
            .env(ROLE, r.to_string())
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", WORLD.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", WORLD.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("FEP_MASTER_PORT", port.to_string())
            .env("FEP_JOB_ID", format!("ffi-ep-{}-{port}", std::process::id()))
            .env_remove("FI_PROVIDER")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn a rank");
        kids.push(child);
    }
    let start = Instant::now();
    let mut outs = Vec::new();
    for (r, mut k) in kids.into_iter().enumerate() {
        let (mut so, mut se) = (k.stdout.take().unwrap(), k.stderr.take().unwrap());
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
        let code = loop {
            match k.try_wait().expect("wait") {
                Some(st) => break st.code(),
                None if start.elapsed() > DEADLINE => {
                    let _ = k.kill();
                    let _ = k.wait();
                    break None;
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        remove_shm_regions(k.id());
        outs.push((r, code, t1.join().unwrap_or_default(), t2.join().unwrap_or_default()));
    }
    for (r, code, out, err) in &outs {
        let tail: String = err.lines().rev().take(12).collect::<Vec<_>>().join("\n");
        assert!(
            *code == Some(0) && out.contains(&format!("OK rank {r}")),
            "rank {r}: exit {code:?}\n{out}\n{tail}"
        );
        // (libtest's "test ... " line precedes the rank's own output on its line.)
        for l in out.lines().filter_map(|l| l.find("OK rank").map(|i| &l[i..])) {
            eprintln!("{l}");
        }
    }
    eprintln!("{WORLD} ranks in {:?}", start.elapsed());
}

unsafe extern "C" fn copy_gather(
    send: *const c_void,
    len: usize,
    recv: *mut c_void,
    _u: *mut c_void,
) -> c_int {
    std::ptr::copy_nonoverlapping(send.cast::<u8>(), recv.cast::<u8>(), len);
    0
}

/// GPU: one object's buffers (a normal and a low-latency shape) report one communication
/// stream, `fep_ep_info`'s. Run on a GPU machine:
/// `cargo test --release --test ffi_ep -- --include-ignored gpu_`.
#[test]
#[ignore = "needs a GPU"]
fn gpu_shapes_share_one_comm_stream() {
    if !fabric_ep::cuda::gpu_available() {
        eprintln!("SKIP: no GPU visible");
        return;
    }
    let mut cfg = ep_config();
    cfg.backend = FEP_BACKEND_GPU;
    (cfg.rank, cfg.num_ranks, cfg.ranks_per_node, cfg.local_rank) = (0, 1, 1, 0);
    cfg.device = 0;
    let mut ep = null_mut();
    let st = unsafe { fep_ep_create(&cfg, Some(copy_gather), null_mut(), &mut ep) };
    assert_eq!(st, FEP_OK, "{}", last_error());
    let mut comm = null_mut();
    let st = unsafe { fep_ep_info(ep, null_mut(), null_mut(), null_mut(), null_mut(), &mut comm) };
    assert_eq!(st, FEP_OK, "{}", last_error());
    assert!(!comm.is_null(), "a GPU fep_ep has a communication stream");
    let bn = ep_buffer(ep, FEP_MODE_NORMAL, H1, FEP_DTYPE_BF16, 0).unwrap();
    let bl = ep_buffer(ep, FEP_MODE_LOW_LATENCY, H1, FEP_DTYPE_FP8_E4M3, MAXT).unwrap();
    let bl16 = ep_buffer(ep, FEP_MODE_LOW_LATENCY, H1, FEP_DTYPE_BF16, MAXT).unwrap();
    assert!(bn != bl && bl != bl16, "the GPU keeps one low-latency buffer per format");
    for b in [bn, bl, bl16] {
        let mut c = null_mut();
        let st = unsafe { fep_gpu_info(b, null_mut(), null_mut(), &mut c) };
        assert_eq!(st, FEP_OK, "{}", last_error());
        assert_eq!(c, comm, "a buffer of the object reports another stream");
    }
    assert_eq!(num_buffers(ep).unwrap(), 3);
    assert_eq!(unsafe { fep_buffer_destroy(bn) }, FEP_ERR_INVALID_ARGUMENT);
    assert_eq!(unsafe { fep_ep_destroy(ep) }, FEP_OK, "{}", last_error());
}
