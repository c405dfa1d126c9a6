//! GPU: the C ABI's GPU entry points (`fep_gpu_*`) driven the way a C caller drives them — ranks
//! as threads of one process on one GPU, bootstrapped through an all-gather callback, device
//! pointers in `fep_tensor`s, a stream in a `fep_gpu_order` — against the single-process
//! reference (src/protocol/reference.rs) on the same inputs: the two-step dispatch (notify, outputs
//! of the returned row count, dispatch), combine, and the `num_worst_tokens` form, bf16 and fp8,
//! world 1, 2 and 4; and a refused argument naming itself. After the first combine each rank
//! also combines again on the same handle without weights and runs a cached dispatch (outputs
//! poisoned first), the order the Python GPU tests use; a second test runs it all without the
//! barriers between steps (ranks drift apart, as with Python threads). Ignored without
//! `--include-ignored` (CI has no GPU); scripts/gpu-check.sh runs it.

mod common;
use common::gpu::gpu;
use std::os::raw::{c_int, c_void};
use std::time::Duration;

use ep_bench::ep::{combine_input, rank_inputs, reference, NormalBenchParams, RankInputs};
use fabric_ep::bootstrap::{Bootstrap, InProcGroup};
use fabric_ep::cuda::{Device, DeviceBuffer, Stream};
use fabric_ep::ffi::*;
use fabric_ep::protocol::config::{DispatchDtype, EpConfig, EpSettings};
use fabric_ep::protocol::reference::{NormalDispatchOut, Tokens};

const E: usize = 16;
const H: usize = 256;
const K: usize = 4;
const T: usize = 40;
/// Spare rows after the combine output; outputs are poisoned with POISON before a step and the
/// bytes past what a step may write must still hold it afterwards (an out-of-bounds write would
/// land in a neighbouring tensor of a caller that allocates exact sizes, as torch does).
const CANARY_ROWS: usize = 8;
const POISON: u8 = 0xAB;

/// `fep_allgather_fn` over an in-process group: `user` is a `&Box<dyn Bootstrap>`.
unsafe extern "C" fn gather(
    send: *const c_void,
    len: usize,
    recv: *mut c_void,
    user: *mut c_void,
) -> c_int {
    let b = &*(user as *const Box<dyn Bootstrap>);
    let data = if len == 0 { &[][..] } else { std::slice::from_raw_parts(send as *const u8, len) };
    match b.all_gather(data) {
        Ok(parts) => {
            for (i, p) in parts.iter().enumerate() {
                if p.len() != len {
                    return 2;
                }
                std::ptr::copy_nonoverlapping(p.as_ptr(), (recv as *mut u8).add(i * len), len);
            }
            0
        }
        Err(_) => 1,
    }
}

fn tensor(b: &DeviceBuffer, dtype: i32, shape: &[usize]) -> fep_tensor {
    let mut s = [0i64; 4];
    for (d, v) in s.iter_mut().zip(shape) {
        *d = *v as i64;
    }
    fep_tensor { data: b.device_ptr() as *mut c_void, dtype, ndim: shape.len() as i32, shape: s }
}

fn ok(what: &str, rank: usize, s: fep_status) {
    if s != FEP_OK {
        // SAFETY: fep_last_error returns a NUL-terminated string valid until the next call.
        let msg = unsafe { std::ffi::CStr::from_ptr(fep_last_error()) }.to_string_lossy();
        panic!("rank {rank}: {what}: {s:?}: {msg}");
    }
}

fn settings(rank: usize, n: usize, fp8: bool) -> EpConfig {
    let mut s = EpSettings::new(rank, n, E, H, K);
    s.ranks_per_node = n;
    if fp8 {
        s.dispatch_dtype = DispatchDtype::Fp8E4m3;
    }
    EpConfig::new(s).expect("config")
}

/// Device copies of one rank's inputs and outputs, all allocated before any step (with ranks
/// as threads, an allocation during a step can wait for a peer's spinning kernel).
struct RankBufs {
    x: DeviceBuffer,
    xs: Option<DeviceBuffer>,
    idx: DeviceBuffer,
    w: DeviceBuffer,
    rx: DeviceBuffer,
    rxs: DeviceBuffer,
    ri: DeviceBuffer,
    rw: DeviceBuffer,
    src: DeviceBuffer,
    cin: DeviceBuffer,
    cin_w: DeviceBuffer,
    cin_worst: DeviceBuffer,
    cx: DeviceBuffer,
    cw: DeviceBuffer,
}

fn run(dev: &Device, n: usize, fp8: bool, barriers: bool) {
    let hp = NormalBenchParams {
        num_tokens: T,
        seed: 0xF1 + n as u64,
        drop_pct: 10,
        iters: 1,
        warmup: 0,
        combine_weights: true,
        one_way: false,
    };
    let cfg0 = settings(0, n, fp8);
    let inputs: Vec<RankInputs> =
        (0..n).map(|r| rank_inputs(&settings(r, n, fp8), &hp, r).expect("inputs")).collect();
    let worst = T * n;
    let (want_d, want_c) = reference(&cfg0, &inputs, 1, None, true).expect("reference");
    let (want_wd, want_wc) = reference(&cfg0, &inputs, 1, Some(worst), true).expect("reference");
    let boots = InProcGroup::new(n, n, Duration::from_secs(30)).expect("group");
    std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, b)| {
                let (me, wd, wc) = (&inputs[rank], &want_d[rank], &want_c[rank]);
                let (wwd, wwc) = (&want_wd[rank], &want_wc[rank]);
                s.spawn(move || {
                    let boot: Box<dyn Bootstrap> = Box::new(b);
                    rank_body(dev, rank, n, fp8, barriers, &boot, me, (wd, wc), (wwd, wwc), worst);
                })
            })
            .collect();
        for (r, h) in hs.into_iter().enumerate() {
            if let Err(e) = h.join() {
                let m = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("world {n} fp8 {fp8}: rank {r} failed: {m}");
            }
        }
    });
    eprintln!(
        "ok: C ABI GPU normal world {n} {}: two-step, combine twice, cached dispatch, \
         num_worst_tokens{}",
        if fp8 { "fp8" } else { "bf16" },
        if barriers { "" } else { ", no barriers between steps" }
    );
}

type Want<'a> = (
    &'a fabric_ep::protocol::reference::NormalDispatchOut,
    &'a fabric_ep::protocol::reference::NormalCombineOut,
);

// NOTES: `&Box<dyn Bootstrap>`, not `&dyn Bootstrap`: the all-gather callback's `user` must be a
// thin pointer.
#[allow(clippy::too_many_arguments, clippy::borrowed_box)]
fn rank_body(
    dev: &Device,
    rank: usize,
    n: usize,
    fp8: bool,
    barriers: bool,
    boot: &Box<dyn Bootstrap>,
    me: &RankInputs,
    want: Want<'_>,
    want_worst: Want<'_>,
    worst: usize,
) {
    let up = |v: &[u8]| DeviceBuffer::from_slice(dev, v).expect("upload");
    let bytes = |v: &[u16]| bytemuck::cast_slice::<u16, u8>(v).to_vec();
    let (wd, wc) = want;
    let (wwd, wwc) = want_worst;
    let xd = if fp8 { FEP_DTYPE_FP8_E4M3 } else { FEP_DTYPE_BF16 };
    let elem = if fp8 { 1 } else { 2 };
    let g = H / 128;
    let b = RankBufs {
        x: match &me.x_fp8 {
            Some((q, _)) => up(q),
            None => up(&bytes(&me.x_bf16)),
        },
        xs: me.x_fp8.as_ref().map(|(_, sc)| up(bytemuck::cast_slice(sc))),
        idx: up(bytemuck::cast_slice(&me.topk_idx)),
        w: up(bytemuck::cast_slice(&me.topk_weights)),
        rx: DeviceBuffer::new(dev, worst * H * elem).expect("alloc"),
        rxs: DeviceBuffer::new(dev, worst * g * 4).expect("alloc"),
        ri: DeviceBuffer::new(dev, worst * K * 8).expect("alloc"),
        rw: DeviceBuffer::new(dev, worst * K * 4).expect("alloc"),
        src: DeviceBuffer::new(dev, worst * 4).expect("alloc"),
        cin: up(&bytes(&combine_input(&wd.recv_x, H).expect("combine input"))),
        cin_w: up(bytemuck::cast_slice(&wd.recv_topk_weights)),
        cin_worst: up(&bytes(&combine_input(&wwd.recv_x, H).expect("combine input"))),
        // CANARY_ROWS spare rows: a write past T lands there and is caught (check_canary).
        cx: DeviceBuffer::new(dev, (T + CANARY_ROWS) * H * 2).expect("alloc"),
        cw: DeviceBuffer::new(dev, T * K * 4).expect("alloc"),
    };
    let stream = Stream::new(dev).expect("stream");
    // NOTES: with barriers, no peer kernel runs while this rank copies out; without, the ranks
    // drift apart as Python's threads do (the copies are synchronous on the legacy stream,
    // which does not wait for the non-blocking streams the kernels run on).
    let step_barrier = || {
        if barriers {
            boot.barrier().expect("barrier");
        }
    };
    let order = fep_gpu_order {
        stream: stream.as_raw() as *mut c_void,
        wait_stream: std::ptr::null_mut(),
        wait_event: std::ptr::null_mut(),
        then_stream: std::ptr::null_mut(),
    };
    // SAFETY: every pointer below is valid for its call; device buffers outlive the stream's
    // work (fep_gpu_sync before they are read or dropped).
    unsafe {
        let mut cfg = std::mem::zeroed::<fep_config>();
        ok("config_init", rank, fep_config_init(&mut cfg));
        cfg.rank = rank as i32;
        cfg.num_ranks = n as i32;
        cfg.ranks_per_node = n as i32;
        cfg.local_rank = rank as i32;
        cfg.num_experts = E as i32;
        cfg.hidden = H as i32;
        cfg.num_topk = K as i32;
        cfg.dispatch_dtype = xd;
        cfg.backend = FEP_BACKEND_GPU;
        cfg.device = dev.ordinal() as i32;
        cfg.timeout_s = 10.0;
        let user = boot as *const Box<dyn Bootstrap> as *mut c_void;
        let mut buf = std::ptr::null_mut();
        ok("buffer_create", rank, fep_buffer_create(&cfg, Some(gather), user, &mut buf));

        let idx = tensor(&b.idx, FEP_DTYPE_I64, &[T, K]);
        let l = E / n;
        for (phase, w) in [(0, None), (1, Some(worst))] {
            let (wd, wc, cin) =
                if w.is_some() { (wwd, wwc, &b.cin_worst) } else { (wd, wc, &b.cin) };
            let mut h = std::ptr::null_mut();
            let mut rows = -1i64;
            let mut per_expert = vec![-1i32; l];
            ok(
                "gpu_notify",
                rank,
                fep_gpu_notify(
                    buf,
                    &idx,
                    1,
                    w.unwrap_or(0) as i64,
                    &order,
                    &mut h,
                    &mut rows,
                    per_expert.as_mut_ptr(),
                ),
            );
            let rows = rows as usize;
            match w {
                Some(w) => assert_eq!(rows, w, "rank {rank}: worst rows"),
                None => {
                    assert_eq!(rows, wd.num_recv_tokens, "rank {rank}: rows");
                    let pe: Vec<usize> = per_expert.iter().map(|&c| c as usize).collect();
                    assert_eq!(pe, wd.num_recv_tokens_per_expert, "rank {rank}: per expert");
                }
            }
            let x = tensor(&b.x, xd, &[T, H]);
            let xs = b.xs.as_ref().map(|s| tensor(s, FEP_DTYPE_F32, &[T, g]));
            let wt = tensor(&b.w, FEP_DTYPE_F32, &[T, K]);
            let rx = tensor(&b.rx, xd, &[rows, H]);
            let rxs = tensor(&b.rxs, FEP_DTYPE_F32, &[rows, g]);
            let ri = tensor(&b.ri, FEP_DTYPE_I64, &[rows, K]);
            let rw = tensor(&b.rw, FEP_DTYPE_F32, &[rows, K]);
            let src = tensor(&b.src, FEP_DTYPE_I32, &[rows]);
            if phase == 0 && rank == 0 {
                // A refused argument names itself and leaves the handle usable.
                let bad = tensor(&b.rx, xd, &[rows + 1, H]);
                let st = fep_gpu_dispatch(
                    buf,
                    h,
                    &x,
                    xs.as_ref().map_or(std::ptr::null(), |t| t),
                    &idx,
                    &wt,
                    &bad,
                    if fp8 { &rxs } else { std::ptr::null() },
                    &ri,
                    &rw,
                    &src,
                    &order,
                );
                let msg = std::ffi::CStr::from_ptr(fep_last_error()).to_string_lossy();
                assert!(st == FEP_ERR_INVALID_ARGUMENT && msg.contains("`recv_x`"), "{st:?} {msg}");
            }
            for o in [&b.rx, &b.rxs, &b.ri, &b.rw, &b.src, &b.cx] {
                o.memset_async(POISON, &stream).expect("poison");
            }
            // The dispatch of `h` into the outputs (also the cached dispatch below).
            let dispatch = |what: &str| {
                let xs_p = xs.as_ref().map_or(std::ptr::null(), |t| t as *const fep_tensor);
                let rxs_p: *const fep_tensor = if fp8 { &rxs } else { std::ptr::null() };
                let st = fep_gpu_dispatch(
                    buf, h, &x, xs_p, &idx, &wt, &rx, rxs_p, &ri, &rw, &src, &order,
                );
                ok(what, rank, st);
                ok("gpu_sync", rank, fep_gpu_sync(buf, order.stream));
            };
            dispatch("gpu_dispatch");
            step_barrier();
            check_recv(rank, &b, wd, "dispatch");
            check_canary(rank, &b, rows, fp8, "dispatch");

            let cx_in = tensor(cin, FEP_DTYPE_BF16, &[rows, H]);
            let cw_in = tensor(&b.cin_w, FEP_DTYPE_F32, &[rows, K]);
            let cx = tensor(&b.cx, FEP_DTYPE_BF16, &[T, H]);
            let cw = tensor(&b.cw, FEP_DTYPE_F32, &[T, K]);
            let with_w = w.is_none();
            step_barrier();
            ok(
                "gpu_combine",
                rank,
                fep_gpu_combine(
                    buf,
                    h,
                    &cx_in,
                    if with_w { &cw_in } else { std::ptr::null() },
                    &cx,
                    if with_w { &cw } else { std::ptr::null() },
                    &order,
                ),
            );
            ok("gpu_sync", rank, fep_gpu_sync(buf, order.stream));
            step_barrier();
            let got: Vec<u16> = b.cx.to_vec().expect("copy");
            assert!(got[..T * H] == wc.combined_x[..], "rank {rank}: combined_x (worst {w:?})");
            assert!(
                bytemuck::cast_slice::<u16, u8>(&got[T * H..]).iter().all(|&v| v == POISON),
                "rank {rank}: combine wrote past its {T} rows"
            );
            if with_w {
                let got: Vec<f32> = b.cw.to_vec().expect("copy");
                assert!(Some(&got) == wc.combined_topk_weights.as_ref(), "rank {rank}: cw");
                // The same handle again: a combine without weights (the combined rows do not
                // depend on them), then a cached dispatch of the same inputs; outputs poisoned.
                b.cx.memset_async(0xAB, &stream).expect("poison");
                ok(
                    "gpu_combine (again)",
                    rank,
                    fep_gpu_combine(
                        buf,
                        h,
                        &cx_in,
                        std::ptr::null(),
                        &cx,
                        std::ptr::null(),
                        &order,
                    ),
                );
                ok("gpu_sync", rank, fep_gpu_sync(buf, order.stream));
                let got: Vec<u16> = b.cx.to_vec().expect("copy");
                assert!(
                    got[..T * H] == wc.combined_x[..],
                    "rank {rank}: combined_x of the second combine"
                );
                for o in [&b.rx, &b.rxs, &b.ri, &b.rw, &b.src] {
                    o.memset_async(0xAB, &stream).expect("poison");
                }
                dispatch("gpu_dispatch (cached)");
                check_recv(rank, &b, wd, "cached dispatch");
                check_canary(rank, &b, rows, fp8, "cached dispatch");
            }
            fep_handle_destroy(h);
            step_barrier();
        }
        ok("buffer_destroy", rank, fep_buffer_destroy(buf));
    }
}

/// The dispatch outputs' received rows against the reference (rows past them are padding).
fn check_recv(rank: usize, b: &RankBufs, wd: &NormalDispatchOut, what: &str) {
    let real = wd.num_recv_tokens;
    let g = H / 128;
    match &wd.recv_x {
        Tokens::Bf16(v) => {
            let got: Vec<u16> = b.rx.to_vec().expect("copy");
            assert!(got[..real * H] == v[..real * H], "rank {rank}: {what}: recv_x");
        }
        Tokens::Fp8 { x, scales } => {
            let got: Vec<u8> = b.rx.to_vec().expect("copy");
            assert!(got[..real * H] == x[..real * H], "rank {rank}: {what}: recv_x fp8");
            let gs: Vec<f32> = b.rxs.to_vec().expect("copy");
            assert!(gs[..real * g] == scales[..real * g], "rank {rank}: {what}: scales");
        }
    }
    let gi: Vec<i64> = b.ri.to_vec().expect("copy");
    assert!(gi[..real * K] == wd.recv_topk_idx[..real * K], "rank {rank}: {what}: recv_topk_idx");
    let gw: Vec<f32> = b.rw.to_vec().expect("copy");
    assert!(gw[..real * K] == wd.recv_topk_weights[..real * K], "rank {rank}: {what}: weights");
}

/// Every dispatch output's bytes past `rows` rows still hold POISON (nothing written out of
/// bounds; the buffers are sized for num_worst_tokens, so the two-step form leaves slack).
fn check_canary(rank: usize, b: &RankBufs, rows: usize, fp8: bool, what: &str) {
    let elem = if fp8 { 1 } else { 2 };
    let mut outs = vec![("recv_x", &b.rx, H * elem), ("recv_topk_idx", &b.ri, K * 8)];
    outs.push(("recv_topk_weights", &b.rw, K * 4));
    outs.push(("recv_src_idx", &b.src, 4));
    if fp8 {
        outs.push(("recv_x_scales", &b.rxs, H / 128 * 4));
    }
    for (name, buf, row_bytes) in outs {
        let got: Vec<u8> = buf.to_vec().expect("copy");
        let bad = got[rows * row_bytes..].iter().position(|&v| v != POISON);
        assert!(bad.is_none(), "rank {rank}: {what} wrote {name} past its {rows} rows: {bad:?}");
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn c_abi_gpu_normal_matches_reference_1_2_4_ranks() {
    let Some(dev) = gpu() else { return };
    for n in [1, 2, 4] {
        for fp8 in [false, true] {
            run(&dev, n, fp8, true);
        }
    }
}

/// As above without the barriers between steps, three times each: the ranks drift apart by up
/// to a step, as Python's rank threads do.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn c_abi_gpu_normal_without_step_barriers() {
    let Some(dev) = gpu() else { return };
    for _ in 0..3 {
        for n in [2, 4] {
            for fp8 in [false, true] {
                run(&dev, n, fp8, false);
            }
        }
    }
}

/// `fep_gpu_layout_*`: DeepEP's layout into caller tensors on caller streams, against the host
/// layout, for several shapes on one object alternating two streams (the shared workspace is
/// ordered between them), then an out-of-range expert id reported by the next call.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn c_abi_gpu_layout_matches_the_host_layout() {
    use fabric_ep::protocol::layout::{dispatch_layout, random_topk_idx, LayoutShape};
    use fabric_ep::util::SplitMix64;
    let Some(dev) = gpu() else { return };
    let (e, r, rpn) = (64usize, 8usize, 4usize);
    let mut l: *mut fep_gpu_layout = std::ptr::null_mut();
    // SAFETY: out-pointer valid.
    ok("create", 0, unsafe { fep_gpu_layout_create(0, e as i32, r as i32, rpn as i32, &mut l) });
    let streams = [Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap()];
    let mut rng = SplitMix64(5);
    for (i, (t, k)) in
        [(0usize, 8usize), (1, 1), (517, 8), (4096, 8), (33, 6)].into_iter().enumerate()
    {
        let shape = LayoutShape::new(t, k, e, r, rpn).unwrap();
        let idx = random_topk_idx(&mut rng, shape, 20, false);
        let want = dispatch_layout(&idx, t, k, e, r, rpn).unwrap();
        let mut d_idx = DeviceBuffer::new(&dev, (t * k * 8).max(8)).unwrap();
        if t > 0 {
            d_idx.copy_from_host(&idx).unwrap();
        }
        let (pr, pn, pe) = (
            DeviceBuffer::new(&dev, 4 * r).unwrap(),
            DeviceBuffer::new(&dev, 4 * (r / rpn)).unwrap(),
            DeviceBuffer::new(&dev, 4 * e).unwrap(),
        );
        let inr = DeviceBuffer::new(&dev, (t * r).max(1)).unwrap();
        for b in [&pr, &pn, &pe, &inr] {
            b.memset(0x7f).unwrap();
        }
        let s = &streams[i % 2];
        let order = fep_gpu_order {
            stream: s.as_raw() as *mut c_void,
            wait_stream: std::ptr::null_mut(),
            wait_event: std::ptr::null_mut(),
            then_stream: std::ptr::null_mut(),
        };
        // SAFETY: every tensor is live device memory of its stated shape until the sync below.
        ok("run", 0, unsafe {
            fep_gpu_layout_run(
                l,
                &tensor(&d_idx, FEP_DTYPE_I64, &[t, k]),
                &tensor(&pr, FEP_DTYPE_I32, &[r]),
                &tensor(&pn, FEP_DTYPE_I32, &[r / rpn]),
                &tensor(&pe, FEP_DTYPE_I32, &[e]),
                &tensor(&inr, FEP_DTYPE_BOOL, &[t, r]),
                &order,
            )
        });
        s.synchronize().unwrap();
        assert_eq!(pr.to_vec::<i32>().unwrap(), want.num_tokens_per_rank, "per rank, {t}x{k}");
        assert_eq!(pn.to_vec::<i32>().unwrap(), want.num_tokens_per_node, "per node, {t}x{k}");
        assert_eq!(pe.to_vec::<i32>().unwrap(), want.num_tokens_per_expert, "per expert, {t}x{k}");
        let got: Vec<bool> =
            inr.to_vec::<u8>().unwrap().into_iter().take(t * r).map(|b| b != 0).collect();
        assert_eq!(got, want.is_token_in_rank, "is_token_in_rank, {t}x{k}");
    }
    // An expert id past the experts: skipped by the kernel, reported by the next call.
    let mut bad = DeviceBuffer::new(&dev, 8).unwrap();
    bad.copy_from_host(&[e as i64 + 3]).unwrap();
    let (pr, pn, pe, inr) = (
        DeviceBuffer::new(&dev, 4 * r).unwrap(),
        DeviceBuffer::new(&dev, 4 * (r / rpn)).unwrap(),
        DeviceBuffer::new(&dev, 4 * e).unwrap(),
        DeviceBuffer::new(&dev, r).unwrap(),
    );
    let order = fep_gpu_order {
        stream: streams[0].as_raw() as *mut c_void,
        wait_stream: std::ptr::null_mut(),
        wait_event: std::ptr::null_mut(),
        then_stream: std::ptr::null_mut(),
    };
    let run = |idx: &DeviceBuffer| unsafe {
        fep_gpu_layout_run(
            l,
            &tensor(idx, FEP_DTYPE_I64, &[1, 1]),
            &tensor(&pr, FEP_DTYPE_I32, &[r]),
            &tensor(&pn, FEP_DTYPE_I32, &[r / rpn]),
            &tensor(&pe, FEP_DTYPE_I32, &[e]),
            &tensor(&inr, FEP_DTYPE_BOOL, &[1, r]),
            &order,
        )
    };
    ok("run (bad id)", 0, run(&bad));
    streams[0].synchronize().unwrap();
    assert_eq!(run(&bad), fep_status::FEP_ERR_INVALID_ARGUMENT, "the bad id is reported next");
    streams[0].synchronize().unwrap();
    // SAFETY: created above; destroyed once (the second is refused).
    unsafe {
        let _ = fep_gpu_layout_destroy(l);
        assert_eq!(fep_gpu_layout_destroy(l), fep_status::FEP_ERR_INVALID_ARGUMENT);
    }
}
