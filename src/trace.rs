//! Event trace for latency diagnosis: where a step's microseconds go between the kernels, the
//! proxy and the fabric. Off by default and free when off (one relaxed atomic load per marked
//! point on the host; one global load per point in the kernels).
//!
//! Two sources, one clock (the host's `CLOCK_REALTIME`, ns):
//! - host points ([`host_event`]): the proxy worker marks batches posted, writes arrived and
//!   send completions while [`enable_host`] is on (process-wide);
//! - device points: the kernels append `%globaltimer` records to a buffer the host installs
//!   ([`crate::cuda::DeviceTrace`]); [`crate::cuda::DeviceTrace::read`] maps them onto the host
//!   clock with an offset measured by [`crate::cuda::DeviceTrace::calibrate`].
//!
//! Kinds are fep_abi.h's `FEP_TRACE_*` (device and host share them). `ep-bench`-style tools turn
//! a merged list into per-interval figures (ep-bench's `trace` module).

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::abi;

/// One trace record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceRecord {
    /// Host clock (`CLOCK_REALTIME`), ns.
    pub t_ns: i64,
    /// `FEP_TRACE_*` (device kinds: base + 16 * phase).
    pub kind: u16,
    pub rank: u16,
    pub arg: u32,
}

impl TraceRecord {
    /// The record word layout shared with the kernels: kind << 48 | rank << 32 | arg.
    pub fn from_word(t_ns: i64, word: u64) -> Self {
        TraceRecord { t_ns, kind: (word >> 48) as u16, rank: (word >> 32) as u16, arg: word as u32 }
    }

    /// Short name of the kind, for printed timelines.
    pub fn kind_name(&self) -> String {
        let k = u32::from(self.kind);
        let base = k % abi::FEP_TRACE_PHASE_STRIDE;
        let phase = if k / abi::FEP_TRACE_PHASE_STRIDE == 1 { "combine" } else { "dispatch" };
        let point = match base {
            abi::FEP_TRACE_LL_SEND_BEGIN => "send_begin",
            abi::FEP_TRACE_LL_SEND_STAGED => "send_staged",
            abi::FEP_TRACE_LL_SEND_PUBLISHED => "send_published",
            abi::FEP_TRACE_LL_RECV_BEGIN => "recv_begin",
            abi::FEP_TRACE_LL_RECV_COUNTS => "recv_counts",
            abi::FEP_TRACE_LL_RECV_END => "recv_end",
            _ => "",
        };
        let np = match k
            .checked_sub(abi::FEP_TRACE_NP_SEND_WAIT)
            .map(|o| o % abi::FEP_TRACE_PHASE_STRIDE)
        {
            Some(0) => "send_wait",
            Some(1) => "send_stage",
            Some(2) => "send_pushed",
            Some(3) => "recv_wait",
            Some(4) => "recv_copy",
            Some(5) => "recv_done",
            _ => "",
        };
        let np_phase = if k >= abi::FEP_TRACE_NP_SEND_WAIT + abi::FEP_TRACE_PHASE_STRIDE {
            "combine"
        } else {
            "dispatch"
        };
        match k {
            abi::FEP_TRACE_PROXY_POSTED => "proxy_posted".into(),
            abi::FEP_TRACE_PROXY_ARRIVAL => "proxy_arrival".into(),
            abi::FEP_TRACE_PROXY_SEND_DONE => "proxy_send_done".into(),
            abi::FEP_TRACE_PROXY_RING_SEEN => "proxy_ring_seen".into(),
            _ if k < 2 * abi::FEP_TRACE_PHASE_STRIDE && !point.is_empty() => {
                format!("ll_{phase}_{point}")
            }
            _ if k < abi::FEP_TRACE_NP_SEND_WAIT + 2 * abi::FEP_TRACE_PHASE_STRIDE
                && !np.is_empty() =>
            {
                format!("normal_{np_phase}_{np}")
            }
            _ => format!("kind_{k}"),
        }
    }
}

/// The host clock of the trace: `CLOCK_REALTIME` in ns.
pub fn now_ns() -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer; CLOCK_REALTIME always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec // time_t and c_long are i64 on 64-bit Linux
}

static HOST_ON: AtomicBool = AtomicBool::new(false);
static HOST: Mutex<Vec<TraceRecord>> = Mutex::new(Vec::new());
/// Host records kept at most (a bound on memory if tracing is left on).
const HOST_CAPACITY: usize = 1 << 20;

/// Starts recording host points (process-wide), dropping earlier records.
pub fn enable_host() {
    HOST.lock().clear();
    HOST_ON.store(true, Ordering::Release);
}

/// Stops recording host points and returns what was recorded.
pub fn take_host() -> Vec<TraceRecord> {
    HOST_ON.store(false, Ordering::Release);
    std::mem::take(&mut *HOST.lock())
}

/// Whether host points are being recorded.
#[inline]
pub fn host_enabled() -> bool {
    HOST_ON.load(Ordering::Relaxed)
}

/// Marks a host point (no-op unless [`enable_host`] is on).
#[inline]
pub fn host_event(kind: u32, rank: u32, arg: u32) {
    if host_enabled() {
        record_host(kind, rank, arg);
    }
}

#[cold]
fn record_host(kind: u32, rank: u32, arg: u32) {
    let r = TraceRecord { t_ns: now_ns(), kind: kind as u16, rank: rank as u16, arg };
    let mut v = HOST.lock();
    if v.len() < HOST_CAPACITY {
        v.push(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Host points are kept only between enable_host and take_host, on the trace clock, in
    /// order. (Other tests' proxies may add points meanwhile: only this test's kind is counted.)
    #[test]
    fn host_points_are_recorded_only_while_enabled() {
        const KIND: u32 = 999;
        host_event(KIND, 7, 1);
        enable_host();
        assert!(host_enabled());
        let before = now_ns();
        host_event(KIND, 7, 2);
        host_event(KIND, 7, 3);
        let mine: Vec<TraceRecord> =
            take_host().into_iter().filter(|r| u32::from(r.kind) == KIND).collect();
        assert!(!host_enabled());
        host_event(KIND, 7, 4);
        assert_eq!(mine.iter().map(|r| r.arg).collect::<Vec<_>>(), [2, 3]);
        assert!(mine.iter().all(|r| r.rank == 7 && r.t_ns >= before));
        assert!(mine[0].t_ns <= mine[1].t_ns);
        assert!(take_host().iter().all(|r| u32::from(r.kind) != KIND));
    }

    #[test]
    fn words_and_names_round_trip() {
        let w = (u64::from(abi::FEP_TRACE_PHASE_STRIDE + abi::FEP_TRACE_LL_RECV_COUNTS) << 48)
            | (3u64 << 32)
            | 1;
        let r = TraceRecord::from_word(5, w);
        assert_eq!((r.kind, r.rank, r.arg), (21, 3, 1));
        assert_eq!(r.kind_name(), "ll_combine_recv_counts");
        let p = TraceRecord { t_ns: 0, kind: abi::FEP_TRACE_PROXY_ARRIVAL as u16, rank: 0, arg: 0 };
        assert_eq!(p.kind_name(), "proxy_arrival");
    }
}
