//! The standard stack that `ep-bench` times beside our normal dispatch/combine: permute (gather
//! each token once per destination rank, grouped by destination), NCCL all-to-all (the counts,
//! one host synchronisation to size the receive, then the rows, as grouped
//! `ncclSend`/`ncclRecv`), and for combine the return trip and the un-permute (per token, the
//! fp32 sum of what came back, in ascending destination order). Same inputs and bytes as our
//! normal mode (fp8 payload + scales out, bf16 back), every result checked against the same
//! reference.
//!
//! Kind to the baseline: the routing metadata (which rows go where, the per-token return
//! positions) is computed on the host before timing, where a framework computes it on the GPU
//! (argsort, bincount) inside the step; and the combine does not sum the top-k weights.
//!
//! NCCL is loaded at run time (`FEP_NCCL_LIB`, else `libnccl.so.2`, else `libnccl.so`; the
//! PyTorch wheels ship it under `site-packages/nvidia/nccl/lib`). NCCL needs one GPU per rank:
//! it refuses two ranks on one device ("Duplicate GPU detected", NCCL 2.28.9 on the H200
//! machine), so this runs at most as many ranks as there are GPUs.
//!
//! NOTES (bounds): our waits here are bounded (the bootstrap's, and stream synchronisation
//! within the run's timeout), but NCCL's own `ncclCommInitRank` has no deadline: a rank that
//! dies between the id exchange and its init leaves the others inside NCCL. Acceptable for a
//! benchmark baseline; nothing of the library calls NCCL.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

use std::sync::Arc;

use super::ep::{self as host_bench, NormalBenchParams, NormalBenchReport, RankInputs};
use super::ep_gpu::{on_threads, upload, upload_tokens, GpuBenchParams, GpuReport};
use fabric_ep::abi;
use fabric_ep::bootstrap::Bootstrap;
use fabric_ep::cuda::launch;
use fabric_ep::cuda::{Device, DeviceBuffer, Event, Stream};
use fabric_ep::protocol::layout::dispatch_layout;
use fabric_ep::protocol::reference::Tokens;
use fabric_ep::protocol::reference::{NormalCombineOut, NormalDispatchOut};
use fabric_ep::{Error, Result};

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

type Comm = *mut c_void;
const NCCL_UINT8: c_int = 1;

type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int;
type CommDestroy = unsafe extern "C" fn(Comm) -> c_int;
type Group = unsafe extern "C" fn() -> c_int;
type SendFn = unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, *mut c_void) -> c_int;
type RecvFn = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// The few NCCL entry points the baseline uses.
struct Nccl {
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    comm_destroy: CommDestroy,
    group_start: Group,
    group_end: Group,
    send: SendFn,
    recv: RecvFn,
    error_string: ErrorString,
    path: String,
}

// SAFETY: plain function pointers into a library that is never unloaded.
unsafe impl Send for Nccl {}
// SAFETY: as above.
unsafe impl Sync for Nccl {}

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local C string or null.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

fn load() -> std::result::Result<Nccl, String> {
    let mut tried = Vec::new();
    let names: Vec<String> = std::env::var("FEP_NCCL_LIB")
        .ok()
        .into_iter()
        .chain(["libnccl.so.2".to_string(), "libnccl.so".to_string()])
        .collect();
    for name in names {
        let c = CString::new(name.clone()).map_err(|e| e.to_string())?;
        // SAFETY: dlopen of a shared library by name; kept open for the process's life.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            tried.push(format!("{name}: {}", dl_error()));
            continue;
        }
        macro_rules! sym {
            ($s:literal, $t:ty) => {{
                let s = CString::new($s).expect("static name");
                // SAFETY: h is a live handle; the symbol's type is NCCL's documented signature.
                let p = unsafe { libc::dlsym(h, s.as_ptr()) };
                if p.is_null() {
                    return Err(format!("{name} lacks {}", $s));
                }
                // SAFETY: as above.
                unsafe { std::mem::transmute::<*mut c_void, $t>(p) }
            }};
        }
        return Ok(Nccl {
            get_unique_id: sym!("ncclGetUniqueId", GetUniqueId),
            comm_init_rank: sym!("ncclCommInitRank", CommInitRank),
            comm_destroy: sym!("ncclCommDestroy", CommDestroy),
            group_start: sym!("ncclGroupStart", Group),
            group_end: sym!("ncclGroupEnd", Group),
            send: sym!("ncclSend", SendFn),
            recv: sym!("ncclRecv", RecvFn),
            error_string: sym!("ncclGetErrorString", ErrorString),
            path: name,
        });
    }
    Err(format!("cannot load NCCL (set FEP_NCCL_LIB): {}", tried.join("; ")))
}

fn nccl() -> Result<&'static Nccl> {
    static LIB: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(|e| Error::Other(e.clone()))
}

/// The library the baseline loaded (for the report), or why none could be.
pub fn nccl_library() -> std::result::Result<String, String> {
    nccl().map(|n| n.path.clone()).map_err(|e| e.to_string())
}

fn check(n: &Nccl, call: &str, r: c_int) -> Result<()> {
    if r == 0 {
        return Ok(());
    }
    // SAFETY: NCCL returns a static string for any result code.
    let s = unsafe { CStr::from_ptr((n.error_string)(r)) }.to_string_lossy().into_owned();
    Err(Error::Other(format!("{call} failed: {s} ({r})")))
}

/// One rank's communicator (destroyed on drop).
struct RankComm {
    n: &'static Nccl,
    comm: Comm,
}

impl Drop for RankComm {
    fn drop(&mut self) {
        // SAFETY: made by ncclCommInitRank; no operation is in flight (streams synchronised).
        unsafe {
            (self.n.comm_destroy)(self.comm);
        }
    }
}

/// Grouped point-to-point: for every peer, send `send[peer]` and receive into `recv[peer]`
/// (byte ranges as (device address, bytes)).
fn exchange(
    c: &RankComm,
    stream: &Stream,
    send: &[(u64, usize)],
    recv: &[(u64, usize)],
) -> Result<()> {
    let n = c.n;
    let s = stream.as_raw() as *mut c_void;
    // SAFETY: addresses are live device memory of this rank's GPU (callers), sized as given.
    unsafe {
        check(n, "ncclGroupStart", (n.group_start)())?;
        for (peer, (&(sp, sb), &(rp, rb))) in send.iter().zip(recv).enumerate() {
            if sb > 0 {
                check(
                    n,
                    "ncclSend",
                    (n.send)(sp as *const c_void, sb, NCCL_UINT8, peer as c_int, c.comm, s),
                )?;
            }
            if rb > 0 {
                check(
                    n,
                    "ncclRecv",
                    (n.recv)(rp as *mut c_void, rb, NCCL_UINT8, peer as c_int, c.comm, s),
                )?;
            }
        }
        check(n, "ncclGroupEnd", (n.group_end)())
    }
}

/// Where each of a rank's tokens goes: rows grouped by destination rank (ascending), tokens
/// ascending within; per token, its rows in ascending destination order (CSR).
struct Routing {
    send_index: Vec<i32>,
    send_counts: Vec<usize>,
    offsets: Vec<i32>,
    rows: Vec<i32>,
}

fn routing(topk_idx: &[i64], t: usize, k: usize, experts: usize, ranks: usize) -> Result<Routing> {
    let lay = dispatch_layout(topk_idx, t, k, experts, ranks, ranks)?;
    let mut send_index = Vec::new();
    let mut send_counts = vec![0usize; ranks];
    let mut per_token: Vec<Vec<i32>> = vec![Vec::new(); t];
    for (d, count) in send_counts.iter_mut().enumerate() {
        for (tok, rows) in per_token.iter_mut().enumerate() {
            if lay.is_token_in_rank[tok * ranks + d] {
                rows.push(send_index.len() as i32);
                send_index.push(tok as i32);
                *count += 1;
            }
        }
    }
    let mut offsets = Vec::with_capacity(t + 1);
    let mut rows = Vec::with_capacity(send_index.len());
    offsets.push(0);
    for r in per_token {
        rows.extend_from_slice(&r);
        offsets.push(rows.len() as i32);
    }
    Ok(Routing { send_index, send_counts, offsets, rows })
}

/// Every rank's inputs, routing and expected outputs (the same in every process).
struct BaselinePrep {
    inputs: Vec<RankInputs>,
    routes: Vec<Routing>,
    want_d: Vec<NormalDispatchOut>,
    want_c: Vec<NormalCombineOut>,
}

impl BaselinePrep {
    fn new(p: &GpuBenchParams) -> Result<Self> {
        let cfg0 = p.config(0)?;
        let (t, h, k, nr) = (p.num_tokens, p.hidden, p.num_topk, p.num_ranks);
        if p.fp8 && (h / 128 * 4) % 16 != 0 {
            return Err(Error::arg(
                "hidden",
                format!("{h}: the baseline needs hidden % 512 == 0 in fp8"),
            ));
        }
        let hp = NormalBenchParams { num_tokens: t, ..p.host_params() };
        let inputs: Vec<RankInputs> =
            (0..nr).map(|r| host_bench::rank_inputs(&cfg0, &hp, r)).collect::<Result<_>>()?;
        let (want_d, want_c) = host_bench::reference(&cfg0, &inputs, 1, None, true)?;
        let routes: Vec<Routing> = inputs
            .iter()
            .map(|i| routing(&i.topk_idx, t, k, p.num_experts, nr))
            .collect::<Result<_>>()?;
        Ok(BaselinePrep { inputs, routes, want_d, want_c })
    }
}

/// The standard stack on `devices` (rank r on `devices[r]`, one rank per GPU, ranks as threads
/// of this process): `warmup + iters` dispatches and combines at `p`'s normal-mode setting, each
/// checked against the reference. Times from CUDA events: dispatch = permute + count exchange +
/// host sync + row all-to-all; combine = return all-to-all + un-permute. `back_to_back` > 0:
/// after the checked steps, that many steps back to back are timed instead (as our normal bench
/// with `GpuSplit::back_to_back`: no barrier between them, outputs poisoned once, the last
/// checked), so both stacks are timed the same way.
pub fn run_nccl_baseline(
    devices: &[Device],
    p: &GpuBenchParams,
    back_to_back: usize,
) -> Result<GpuReport> {
    if devices.len() < p.num_ranks {
        return Err(Error::arg(
            "ranks",
            format!(
                "{} ranks on {} GPU(s): NCCL refuses two ranks on one GPU (one GPU per rank)",
                p.num_ranks,
                devices.len()
            ),
        ));
    }
    let n = nccl()?;
    let prep = BaselinePrep::new(p)?;
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: out-pointer valid.
    check(n, "ncclGetUniqueId", unsafe { (n.get_unique_id)(&mut id) })?;
    on_threads(p.num_ranks, p.timeout, |rank, boot| {
        baseline_rank(&devices[rank], p, &prep, id, rank, boot, back_to_back)
    })
}

/// One rank of the baseline when the ranks are processes, one per GPU (`boot`: this rank's
/// bootstrap, world size `p.num_ranks`; `dev`: this rank's GPU). Rank 0 makes NCCL's unique
/// id and the bootstrap carries it to the others. Collective. `back_to_back` as in
/// [`run_nccl_baseline`].
pub fn run_nccl_baseline_rank(
    dev: &Device,
    p: &GpuBenchParams,
    boot: Arc<dyn Bootstrap>,
    back_to_back: usize,
) -> Result<NormalBenchReport> {
    if boot.world_size() != p.num_ranks {
        return Err(Error::arg(
            "num_ranks",
            format!("{} in the parameters, the job has {}", p.num_ranks, boot.world_size()),
        ));
    }
    let n = nccl()?;
    let prep = BaselinePrep::new(p)?;
    let mut id = UniqueId { internal: [0; 128] };
    if boot.rank() == 0 {
        // SAFETY: out-pointer valid.
        check(n, "ncclGetUniqueId", unsafe { (n.get_unique_id)(&mut id) })?;
    }
    let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
    let all = boot.all_gather(&bytes)?;
    let root = all.first().filter(|b| b.len() == 128).ok_or_else(|| Error::Protocol {
        rank: boot.rank(),
        peer: 0,
        phase: "NCCL unique id",
        msg: "malformed id".into(),
    })?;
    for (i, b) in root.iter().enumerate() {
        id.internal[i] = *b as c_char;
    }
    baseline_rank(dev, p, &prep, id, boot.rank(), boot, back_to_back)
}

/// One rank's baseline run (a thread or a process), every step checked.
fn baseline_rank(
    dev: &Device,
    p: &GpuBenchParams,
    prep: &BaselinePrep,
    id: UniqueId,
    rank: usize,
    boot: Arc<dyn Bootstrap>,
    back_to_back: usize,
) -> Result<NormalBenchReport> {
    let n = nccl()?;
    let cfg0 = p.config(0)?;
    let (t, h, nr) = (p.num_tokens, p.hidden, p.num_ranks);
    let (inputs, routes, want_d, want_c) = (&prep.inputs, &prep.routes, &prep.want_d, &prep.want_c);
    dev.bind()?;
    let mut comm: Comm = std::ptr::null_mut();
    // SAFETY: every rank calls this concurrently (threads or processes), context bound.
    check(n, "ncclCommInitRank", unsafe {
        (n.comm_init_rank)(&mut comm, nr as c_int, id, rank as c_int)
    })?;
    let comm = RankComm { n, comm };
    let me = &inputs[rank];
    let ro = &routes[rank];
    let want = &want_d[rank];
    let (pay, sc) = match &me.x_fp8 {
        Some(_) => (h, h / 128 * 4),
        None => (2 * h, 0),
    };
    let rows_out = ro.send_index.len();
    let rows_in = want.num_recv_tokens;
    let (x, xs) = upload_tokens(dev, me)?;
    let index = upload(dev, &ro.send_index)?;
    let offsets = upload(dev, &ro.offsets)?;
    let back_rows = upload(dev, &ro.rows)?;
    let send_x = DeviceBuffer::new(dev, (rows_out * pay).max(16))?;
    let send_s = DeviceBuffer::new(dev, (rows_out * sc).max(16))?;
    // Receive buffers sized for the worst case, allocated before any step.
    let cap = t * nr;
    let recv_x = DeviceBuffer::new(dev, (cap * pay).max(16))?;
    let recv_s = DeviceBuffer::new(dev, (cap * sc).max(16))?;
    let counts_out: Vec<u32> = ro.send_counts.iter().map(|&c| c as u32).collect();
    let counts_dev = upload(dev, &counts_out)?;
    let counts_in = DeviceBuffer::zeroed(dev, 4 * nr)?;
    let cx = upload(dev, &host_bench::combine_input(&want.recv_x, h)?)?;
    let back = DeviceBuffer::new(dev, (rows_out * 2 * h).max(16))?;
    let out = DeviceBuffer::new(dev, (t * 2 * h).max(16))?;
    let stream = Stream::new(dev)?;
    let ev: Vec<Event> = (0..3).map(|_| Event::new(dev)).collect::<std::result::Result<_, _>>()?;
    // Back-to-back steps: [0] before the first, [2 i + 1] after step i's dispatch, [2 i + 2]
    // after its combine.
    let bev: Vec<Event> = (0..2 * back_to_back + usize::from(back_to_back > 0))
        .map(|_| Event::new(dev))
        .collect::<std::result::Result<_, _>>()?;
    let sent = rows_out as u64;
    let mut rep = NormalBenchReport {
        dispatch_s: Vec::new(),
        combine_s: Vec::new(),
        dispatch_bytes: sent * cfg0.dispatch_dtype.token_bytes(h as u64),
        combine_bytes: sent * 2 * h as u64,
    };
    let grid = 264u32;
    let limit = p.timeout;
    let offs = |counts: &[usize]| -> Vec<usize> {
        let mut o = vec![0usize; counts.len() + 1];
        for (i, c) in counts.iter().enumerate() {
            o[i + 1] = o[i] + c;
        }
        o
    };
    let so = offs(&ro.send_counts);
    // One step on the stream (dispatch, then `after_dispatch`, combine, then `after_combine`);
    // returns the rows received. Its count exchange synchronises the host with the stream.
    let step = |after_dispatch: &Event, after_combine: &Event| -> Result<usize> {
        // SAFETY: every address below is a live buffer of this rank sized for what the
        // kernel or NCCL touches (rows_out send rows, at most t * nr receive rows).
        unsafe {
            launch::gather_rows(
                &stream,
                grid,
                abi::fep_gather_rows_params {
                    src: x.device_ptr(),
                    index: index.device_ptr(),
                    dst: send_x.device_ptr(),
                    row_bytes: pay as u32,
                    num_rows: rows_out as i32,
                },
            )?;
            if let Some(xs) = &xs {
                launch::gather_rows(
                    &stream,
                    grid,
                    abi::fep_gather_rows_params {
                        src: xs.device_ptr(),
                        index: index.device_ptr(),
                        dst: send_s.device_ptr(),
                        row_bytes: sc as u32,
                        num_rows: rows_out as i32,
                    },
                )?;
            }
        }
        let one: Vec<(u64, usize)> =
            (0..nr).map(|d| (counts_dev.device_ptr() + 4 * d as u64, 4)).collect();
        let one_in: Vec<(u64, usize)> =
            (0..nr).map(|s| (counts_in.device_ptr() + 4 * s as u64, 4)).collect();
        exchange(&comm, &stream, &one, &one_in)?;
        stream.synchronize_within(limit)?;
        let rc: Vec<u32> = counts_in.to_vec()?;
        let rc: Vec<usize> = rc.iter().map(|&c| c as usize).collect();
        let total: usize = rc.iter().sum();
        if total > cap {
            return Err(Error::Other(format!("rank {rank}: {total} rows exceed {cap}")));
        }
        let ro_in = offs(&rc);
        let snd = |base: u64, w: usize| -> Vec<(u64, usize)> {
            (0..nr).map(|d| (base + (so[d] * w) as u64, ro.send_counts[d] * w)).collect()
        };
        let rcv = |base: u64, w: usize| -> Vec<(u64, usize)> {
            (0..nr).map(|s| (base + (ro_in[s] * w) as u64, rc[s] * w)).collect()
        };
        exchange(&comm, &stream, &snd(send_x.device_ptr(), pay), &rcv(recv_x.device_ptr(), pay))?;
        if sc > 0 {
            exchange(&comm, &stream, &snd(send_s.device_ptr(), sc), &rcv(recv_s.device_ptr(), sc))?;
        }
        after_dispatch.record(&stream)?;
        // Combine: the expert outputs (rows as received) go back to their sources.
        exchange(&comm, &stream, &rcv(cx.device_ptr(), 2 * h), &snd(back.device_ptr(), 2 * h))?;
        // SAFETY: as above; offsets/rows index rows_out rows of `back`.
        unsafe {
            launch::segment_sum(
                &stream,
                grid,
                abi::fep_segment_sum_params {
                    src: back.device_ptr(),
                    offsets: offsets.device_ptr(),
                    rows: back_rows.device_ptr(),
                    out: out.device_ptr(),
                    hidden: h as i32,
                    num_tokens: t as i32,
                },
            )?;
        }
        after_combine.record(&stream)?;
        Ok(total)
    };
    let check = |total: usize, it: usize| -> Result<()> {
        if total != rows_in {
            return Err(Error::Other(format!(
                "rank {rank}: NCCL baseline received {total} rows, the reference {rows_in}"
            )));
        }
        let got: Vec<u8> = recv_x.to_vec()?;
        let same = match &want.recv_x {
            Tokens::Bf16(v) => {
                got[..rows_in * pay] == *bytemuck::cast_slice::<u16, u8>(&v[..rows_in * h])
            }
            Tokens::Fp8 { x, scales } => {
                let s: Vec<f32> = recv_s.to_vec()?;
                got[..rows_in * h] == x[..rows_in * h]
                    && s[..rows_in * (h / 128)] == scales[..rows_in * (h / 128)]
            }
        };
        if !same {
            return Err(Error::Other(format!(
                "rank {rank}: NCCL baseline dispatch differs from the reference (iteration {it})"
            )));
        }
        let got: Vec<u16> = out.to_vec()?;
        if got[..t * h] != want_c[rank].combined_x[..] {
            return Err(Error::Other(format!(
                "rank {rank}: NCCL baseline combine differs from the reference (iteration {it})"
            )));
        }
        Ok(())
    };
    for it in 0..p.warmup + p.iters {
        boot.barrier()?;
        recv_x.memset_async(0xAB, &stream)?;
        out.memset_async(0xAB, &stream)?;
        ev[0].record(&stream)?;
        let total = step(&ev[1], &ev[2])?;
        stream.synchronize_within(limit)?;
        check(total, it)?;
        if it >= p.warmup {
            rep.dispatch_s.push(ev[0].elapsed_ms(&ev[1])? as f64 * 1e-3);
            rep.combine_s.push(ev[1].elapsed_ms(&ev[2])? as f64 * 1e-3);
        }
    }
    if back_to_back > 0 {
        boot.barrier()?;
        recv_x.memset_async(0xAB, &stream)?;
        out.memset_async(0xAB, &stream)?;
        stream.synchronize_within(limit)?;
        boot.barrier()?;
        bev[0].record(&stream)?;
        let mut total = 0;
        for i in 0..back_to_back {
            total = step(&bev[2 * i + 1], &bev[2 * i + 2])?;
        }
        stream.synchronize_within(limit)?;
        // The last step is still checked.
        check(total, p.warmup + p.iters + back_to_back - 1)?;
        rep.dispatch_s.clear();
        rep.combine_s.clear();
        for i in 0..back_to_back {
            rep.dispatch_s.push(bev[2 * i].elapsed_ms(&bev[2 * i + 1])? as f64 * 1e-3);
            rep.combine_s.push(bev[2 * i + 1].elapsed_ms(&bev[2 * i + 2])? as f64 * 1e-3);
        }
    }
    boot.barrier()?;
    drop(comm);
    Ok(rep)
}
