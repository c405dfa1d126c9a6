//! Typed launchers: one function per kernel, taking the kernel's `#[repr(C)]` parameter struct
//! (from `kernels/include/fep_abi.h`) by value.
//!
//! All are `unsafe`: the structs carry raw device addresses, which must point at live memory of
//! the sizes the struct's doc comments give until the stream has finished the launch.

use super::driver::call;
use super::module::Kernel;
use super::stream::Stream;
use super::{CudaError, CudaResult};
use crate::abi;
use bytemuck::Pod;

/// Grid and block shape (1-D) and dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: u32,
    pub block: u32,
    pub shared_bytes: u32,
}

/// Launches `kernel` with one by-value parameter struct.
///
/// # Safety
/// `params` must be the struct `kernel` takes, and every address in it must stay valid until the
/// launch completes on `stream`.
unsafe fn launch<P: Pod>(
    stream: &Stream,
    kernel: Kernel,
    cfg: LaunchConfig,
    params: &P,
) -> CudaResult<()> {
    launch_with(stream, kernel, cfg, params, false)
}

/// Whether the low-latency kernels are launched with programmatic dependent launch
/// (`FEP_LL_PDL=0` turns it off, e.g. to measure what it saves; read once).
pub fn ll_pdl() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FEP_LL_PDL").map_or(true, |v| v.trim() != "0"))
}

/// Warps per block that move the normal dispatch's row payloads with bulk copies through
/// shared memory (`fep_normal_dispatch_params::bulk_movers`; 0: through registers) for rows of
/// `payload_bytes`. `FEP_DISPATCH_BULK` overrides it (`0`: registers; `1`..`8` movers), read
/// once; else rows of 4 KiB and more take 2 movers, smaller rows registers (a bulk copy costs
/// its issuing lane about the same whatever its size).
pub fn dispatch_movers(payload_bytes: u32) -> u32 {
    static FORCED: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| {
        std::env::var("FEP_DISPATCH_BULK")
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
            .map(|n| n.min(abi::FEP_NORMAL_MAX_MOVERS))
    });
    forced.unwrap_or(if payload_bytes >= 4096 { 2 } else { 0 })
}

/// [`launch`], optionally with the programmatic-stream-serialization attribute (`pdl`): the
/// grid may launch once the previous grid of the stream has triggered
/// (`griddepcontrol.launch_dependents`), and must itself wait (`griddepcontrol.wait`) before
/// reading anything earlier work wrote (the LL kernels do: `pdl_enter`, fep_ll.cuh). Not while
/// the stream captures a graph.
///
/// NOTES: a captured kernel keeps no programmatic dependency on work before the graph: on the
/// H200 a replayed combine-send graph read the layout its rank's dispatch-receive graph had not
/// yet written (4 ranks as threads, one graph per phase), so a capturing stream gets a plain
/// launch.
unsafe fn launch_with<P: Pod>(
    stream: &Stream,
    kernel: Kernel,
    cfg: LaunchConfig,
    params: &P,
    pdl: bool,
) -> CudaResult<()> {
    if cfg.grid == 0 || cfg.block == 0 || cfg.block > 1024 {
        return Err(CudaError::InvalidArgument {
            arg: "cfg",
            msg: format!("grid {} x block {} for {}", cfg.grid, cfg.block, kernel.symbol()),
        });
    }
    let dev = stream.device();
    let f = dev.function(kernel)?;
    dev.bind()?;
    let mut args = [params as *const P as *mut std::ffi::c_void];
    if pdl && !stream.is_capturing()? {
        use cudarc::driver::sys;
        // SAFETY: a zeroed attribute value union is valid; the field set is the one `id` names.
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let lc = sys::CUlaunchConfig {
            gridDimX: cfg.grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: cfg.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: cfg.shared_bytes,
            hStream: stream.as_raw(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as below; `lc` and `attr` outlive the call (the driver copies them).
        return call!(cuLaunchKernelEx(&lc, f, args.as_mut_ptr(), std::ptr::null_mut()));
    }
    // SAFETY: (caller) `params` matches the kernel's single by-value parameter; the driver copies
    // it before returning.
    call!(cuLaunchKernel(
        f,
        cfg.grid,
        1,
        1,
        cfg.block,
        1,
        1,
        cfg.shared_bytes,
        stream.as_raw(),
        args.as_mut_ptr(),
        std::ptr::null_mut()
    ))
}

/// `fep_dispatch_layout` (kernels/layout.cu): any grid, `FEP_LAYOUT_THREADS` threads.
/// `ep::layout_gpu::DispatchLayoutGpu` picks the grid, tile and shared memory.
///
/// # Safety
/// Every address in `p` is live for the sizes its doc comments give, until the launch completes;
/// `p.workspace` is not used by another launch at the same time.
pub unsafe fn dispatch_layout(
    stream: &Stream,
    cfg: LaunchConfig,
    p: abi::fep_layout_params,
) -> CudaResult<()> {
    if cfg.block != abi::FEP_LAYOUT_THREADS {
        return Err(CudaError::InvalidArgument {
            arg: "cfg.block",
            msg: format!(
                "{} threads, the kernel is built for {}",
                cfg.block,
                abi::FEP_LAYOUT_THREADS
            ),
        });
    }
    launch(stream, Kernel::DispatchLayout, cfg, &p)
}

/// `fep_dispatch_layout_cluster` (kernels/layout.cu): exactly one cluster,
/// `FEP_LAYOUT_CLUSTER_BLOCKS` blocks of `FEP_LAYOUT_CLUSTER_THREADS` threads (needs sm_90+).
///
/// # Safety
/// Every address in `p` is live for the sizes its doc comments give, until the launch completes.
pub unsafe fn dispatch_layout_cluster(
    stream: &Stream,
    cfg: LaunchConfig,
    p: abi::fep_layout_params,
) -> CudaResult<()> {
    if cfg.block != abi::FEP_LAYOUT_CLUSTER_THREADS || cfg.grid != abi::FEP_LAYOUT_CLUSTER_BLOCKS {
        return Err(CudaError::InvalidArgument {
            arg: "cfg",
            msg: format!(
                "grid {} x {} threads, the kernel is one cluster of {} x {}",
                cfg.grid,
                cfg.block,
                abi::FEP_LAYOUT_CLUSTER_BLOCKS,
                abi::FEP_LAYOUT_CLUSTER_THREADS
            ),
        });
    }
    launch(stream, Kernel::DispatchLayoutCluster, cfg, &p)
}

#[cfg(feature = "bench-kernels")]
/// `fep_wait_test`: one thread waits (bounded) for `*counter >= expected`.
///
/// # Safety
/// `p.counter` and `p.dev_error` are live until the launch completes.
pub unsafe fn wait_test(stream: &Stream, p: abi::fep_wait_test_params) -> CudaResult<()> {
    launch(stream, Kernel::WaitTest, LaunchConfig { grid: 1, block: 32, shared_bytes: 0 }, &p)
}

#[cfg(feature = "bench-kernels")]
/// `fep_wait_packed_test`: one thread waits (bounded) until the high half of `*counter` equals
/// `expected as u32` modulo 2^32 (a counter line's `packed` word, fep_device.cuh
/// `wait_packed_eq`); a high half ahead of it is recorded as `FEP_DEV_BAD_COUNT`. On success it
/// stores the word it saw at `counter + 8`.
///
/// # Safety
/// `p.counter` (16 bytes) and `p.dev_error` are live until the launch completes.
pub unsafe fn wait_packed_test(stream: &Stream, p: abi::fep_wait_test_params) -> CudaResult<()> {
    launch(stream, Kernel::WaitPackedTest, LaunchConfig { grid: 1, block: 32, shared_bytes: 0 }, &p)
}

#[cfg(feature = "bench-kernels")]
/// `fep_ring_push_test`: one thread pushes `num_cmds` commands into the ring, then waits
/// (bounded) for the arrival counter.
///
/// # Safety
/// `p.ring` (header + `capacity` commands), `p.arrival` and `p.dev_error` are live until the
/// launch completes.
pub unsafe fn ring_push_test(stream: &Stream, p: abi::fep_ring_push_test_params) -> CudaResult<()> {
    if p.capacity == 0 {
        return Err(CudaError::InvalidArgument { arg: "capacity", msg: "must be > 0".into() });
    }
    launch(stream, Kernel::RingPushTest, LaunchConfig { grid: 1, block: 32, shared_bytes: 0 }, &p)
}

#[cfg(feature = "bench-kernels")]
/// Threads per block of `fep_proxy_exchange_test`.
pub const PROXY_EXCHANGE_THREADS: u32 = 256;

#[cfg(feature = "bench-kernels")]
/// `fep_proxy_exchange_test` (kernels/proxy_test.cu): one block writes `num_msgs` payloads into
/// the send region and pushes their commands to the proxy ring, waits (bounded) for the peer's
/// arrivals, then counts received bytes that differ from the pattern into `p.mismatches`.
///
/// # Safety
/// `p.ring` (header + `capacity` commands), `p.send` and `p.recv` (mapped host memory covering
/// every message), `p.arrivals`, `p.mismatches` (device memory, 4 bytes) and `p.dev_error` are
/// live until the launch completes; the proxy does not read a send slot before its command.
pub unsafe fn proxy_exchange_test(
    stream: &Stream,
    p: abi::fep_proxy_exchange_params,
) -> CudaResult<()> {
    if p.capacity == 0 || p.stride == 0 {
        return Err(CudaError::InvalidArgument {
            arg: "p",
            msg: format!("capacity {} and stride {} must be > 0", p.capacity, p.stride),
        });
    }
    let cfg = LaunchConfig { grid: 1, block: PROXY_EXCHANGE_THREADS, shared_bytes: 0 };
    launch(stream, Kernel::ProxyExchangeTest, cfg, &p)
}

#[cfg(feature = "bench-kernels")]
/// `fep_proxy_pingpong` (kernels/proxy_test.cu): one thread, `iters` rounds through the proxy,
/// clock64 stamped into `p.timestamps[0..=iters]`, globaltimer into `p.globaltimer[0..2]`.
///
/// # Safety
/// `p.ring`, `p.arrivals`, `p.timestamps` (`iters + 1` u64), `p.globaltimer` (2 u64) and
/// `p.dev_error` are live until the launch completes.
pub unsafe fn proxy_pingpong(stream: &Stream, p: abi::fep_proxy_pingpong_params) -> CudaResult<()> {
    if p.capacity == 0 {
        return Err(CudaError::InvalidArgument { arg: "capacity", msg: "must be > 0".into() });
    }
    launch(stream, Kernel::ProxyPingpong, LaunchConfig { grid: 1, block: 32, shared_bytes: 0 }, &p)
}

/// `fep_trace_clock` (kernels/trace.cu): one block of 32 threads.
///
/// # Safety
/// `p.out` is 16 bytes of mapped host memory that stays valid until the launch completes.
pub unsafe fn trace_clock(stream: &Stream, p: abi::fep_trace_clock_params) -> CudaResult<()> {
    launch(stream, Kernel::TraceClock, LaunchConfig { grid: 1, block: 32, shared_bytes: 0 }, &p)
}

fn ll_cfg_check(cfg: LaunchConfig, what: &'static str) -> CudaResult<()> {
    if cfg.block != abi::FEP_LL_THREADS || cfg.shared_bytes > 48 * 1024 {
        return Err(CudaError::InvalidArgument {
            arg: "cfg",
            msg: format!(
                "{what}: block {} (built for {}), {} bytes of shared memory (at most 48 KiB)",
                cfg.block,
                abi::FEP_LL_THREADS,
                cfg.shared_bytes
            ),
        });
    }
    Ok(())
}

/// `fep_ll_dispatch_send` (kernels/ll_dispatch.cu): any grid, `FEP_LL_THREADS` threads; dynamic
/// shared memory `K * 8 + (T * K + E) * 4`. `ep::ll_gpu` plans and checks every field.
///
/// # Safety
/// Every address in `p` (peers' buffers included) is live for the sizes fep_abi.h gives until
/// the launch completes; `p.workspace` is used by no other launch at the same time.
pub unsafe fn ll_dispatch_send(
    stream: &Stream,
    cfg: LaunchConfig,
    p: abi::fep_ll_dispatch_params,
) -> CudaResult<()> {
    ll_cfg_check(cfg, "fep_ll_dispatch_send")?;
    launch(stream, Kernel::LlDispatchSend, cfg, &p)
}

/// `fep_ll_dispatch_recv` (the receive hook): any grid, `FEP_LL_THREADS` threads; dynamic shared
/// memory `(2 * E + 1) * 4`. `chained`: launched right after its send on the same stream, with
/// nothing in between, so it may use programmatic dependent launch ([`ll_pdl`]).
///
/// NOTES: only then. With an event record/wait between the kernels (a hook's receive, or the
/// next phase's send after the stream joins) the H200 let the later kernel pass
/// `griddepcontrol.wait` while the earlier one still ran (a combine send published counts of a
/// layout its dispatch receive had not written; across graph boundaries likewise).
///
/// # Safety
/// As [`ll_dispatch_send`].
pub unsafe fn ll_dispatch_recv(
    stream: &Stream,
    cfg: LaunchConfig,
    p: abi::fep_ll_dispatch_params,
    chained: bool,
) -> CudaResult<()> {
    ll_cfg_check(cfg, "fep_ll_dispatch_recv")?;
    launch_with(stream, Kernel::LlDispatchRecv, cfg, &p, chained && ll_pdl())
}

/// `fep_ll_combine_send` (kernels/ll_combine.cu): any grid, `FEP_LL_THREADS` threads; dynamic
/// shared memory `(2 * E + 1) * 4`.
///
/// # Safety
/// As [`ll_dispatch_send`].
pub unsafe fn ll_combine_send(
    stream: &Stream,
    cfg: LaunchConfig,
    p: abi::fep_ll_combine_params,
) -> CudaResult<()> {
    ll_cfg_check(cfg, "fep_ll_combine_send")?;
    launch(stream, Kernel::LlCombineSend, cfg, &p)
}

/// `fep_ll_combine_recv` (the receive hook): any grid, `FEP_LL_THREADS` threads; dynamic shared
/// memory `K * 12 + E * 4`. `chained`: as in [`ll_dispatch_recv`].
///
/// # Safety
/// As [`ll_dispatch_send`].
pub unsafe fn ll_combine_recv(
    stream: &Stream,
    cfg: LaunchConfig,
    p: abi::fep_ll_combine_params,
    chained: bool,
) -> CudaResult<()> {
    ll_cfg_check(cfg, "fep_ll_combine_recv")?;
    launch_with(stream, Kernel::LlCombineRecv, cfg, &p, chained && ll_pdl())
}

/// `fep_normal_notify` (kernels/normal_notify.cu): one block of `FEP_NORMAL_NOTIFY_THREADS` per
/// rank. `ep::normal_gpu` fills the params and checks the buffer sizes.
///
/// # Safety
/// Every address in `p` (comm buffers of all peers, handle, layout outputs) is live and sized as
/// `fep_abi.h` documents until the launch completes; the peers' kernels run concurrently.
pub unsafe fn normal_notify(stream: &Stream, p: abi::fep_normal_notify_params) -> CudaResult<()> {
    let cfg = LaunchConfig {
        grid: p.comm.num_ranks,
        block: abi::FEP_NORMAL_NOTIFY_THREADS,
        shared_bytes: 0,
    };
    launch(stream, Kernel::NormalNotify, cfg, &p)
}

/// `fep_normal_dispatch` (kernels/normal_dispatch.cu): `grid` blocks (the SM budget, at least
/// 2 x num_ranks) of `FEP_NORMAL_THREADS`, with all the dynamic shared memory a block may have
/// (the ring of its bulk row copies, kernels/include/fep_tma.cuh).
///
/// # Safety
/// As [`normal_notify`]; plus the inputs and outputs in `p`.
pub unsafe fn normal_dispatch(
    stream: &Stream,
    grid: u32,
    p: abi::fep_normal_dispatch_params,
) -> CudaResult<()> {
    check_normal_grid(grid, p.comm.num_ranks)?;
    // The rings take all the shared memory a block may have; without movers none is needed.
    let shared_bytes = if p.bulk_movers != 0 { stream.device().max_dynamic_smem() } else { 0 };
    let cfg = LaunchConfig { grid, block: abi::FEP_NORMAL_THREADS, shared_bytes };
    launch(stream, Kernel::NormalDispatch, cfg, &p)
}

/// `fep_normal_combine` (kernels/normal_combine.cu; `_1` / `_2` at one / two ranks): as
/// [`normal_dispatch`].
///
/// # Safety
/// As [`normal_dispatch`].
pub unsafe fn normal_combine(
    stream: &Stream,
    grid: u32,
    p: abi::fep_normal_combine_params,
) -> CudaResult<()> {
    check_normal_grid(grid, p.comm.num_ranks)?;
    let cfg = LaunchConfig { grid, block: abi::FEP_NORMAL_THREADS, shared_bytes: 0 };
    // Same kernel, built per bound on the ranks a token's rows come from (normal_combine.cu).
    let k = match p.comm.num_ranks {
        1 => Kernel::NormalCombine1,
        2 => Kernel::NormalCombine2,
        _ => Kernel::NormalCombine,
    };
    launch(stream, k, cfg, &p)
}

fn check_normal_grid(grid: u32, num_ranks: u32) -> CudaResult<()> {
    if num_ranks == 0 || num_ranks > abi::FEP_NORMAL_MAX_RANKS || grid < 2 * num_ranks {
        return Err(CudaError::InvalidArgument {
            arg: "grid",
            msg: format!(
                "{grid} blocks for {num_ranks} ranks: needs 2 x num_ranks blocks, ranks <= {}",
                abi::FEP_NORMAL_MAX_RANKS
            ),
        });
    }
    Ok(())
}

#[cfg(feature = "bench-kernels")]
/// `fep_copy_bytes` (kernels/baseline.cu): `grid` blocks of `FEP_COPY_THREADS`.
///
/// # Safety
/// `p.src` and `p.dst` must address `p.vecs * 16` bytes of device memory each, 16-byte aligned,
/// not overlapping, alive until the launch completes.
pub unsafe fn copy_bytes(stream: &Stream, grid: u32, p: abi::fep_copy_params) -> CudaResult<()> {
    if grid == 0 {
        return Err(CudaError::InvalidArgument { arg: "grid", msg: "must be at least 1".into() });
    }
    let cfg = LaunchConfig { grid, block: abi::FEP_COPY_THREADS, shared_bytes: 0 };
    launch(stream, Kernel::CopyBytes, cfg, &p)
}

#[cfg(feature = "bench-kernels")]
/// `fep_gather_rows` (kernels/baseline.cu): `grid` blocks of `FEP_BASELINE_THREADS`.
///
/// # Safety
/// `p.src` holds every row `p.index` names, `p.dst` holds `num_rows` rows, all 16-byte aligned
/// and live until the launch completes.
pub unsafe fn gather_rows(
    stream: &Stream,
    grid: u32,
    p: abi::fep_gather_rows_params,
) -> CudaResult<()> {
    if p.row_bytes % 16 != 0 || p.num_rows < 0 {
        return Err(CudaError::InvalidArgument {
            arg: "row_bytes",
            msg: format!(
                "{} bytes per row ({} rows): must be a multiple of 16",
                p.row_bytes, p.num_rows
            ),
        });
    }
    let cfg = LaunchConfig { grid, block: abi::FEP_BASELINE_THREADS, shared_bytes: 0 };
    launch(stream, Kernel::GatherRows, cfg, &p)
}

#[cfg(feature = "bench-kernels")]
/// `fep_segment_sum` (kernels/baseline.cu): `grid` blocks of `FEP_BASELINE_THREADS`.
///
/// # Safety
/// `p.offsets` has `num_tokens + 1` entries, `p.rows` every index they span, each naming a row
/// of `p.src`; `p.out` holds `num_tokens` rows; all live until the launch completes.
pub unsafe fn segment_sum(
    stream: &Stream,
    grid: u32,
    p: abi::fep_segment_sum_params,
) -> CudaResult<()> {
    if p.hidden % 8 != 0 || p.hidden <= 0 || p.num_tokens < 0 {
        return Err(CudaError::InvalidArgument {
            arg: "hidden",
            msg: format!(
                "{} (tokens {}): must be a positive multiple of 8",
                p.hidden, p.num_tokens
            ),
        });
    }
    let cfg = LaunchConfig { grid, block: abi::FEP_BASELINE_THREADS, shared_bytes: 0 };
    launch(stream, Kernel::SegmentSum, cfg, &p)
}
