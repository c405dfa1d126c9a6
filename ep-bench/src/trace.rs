//! Turns a low-latency run's event trace ([`fabric_ep::trace`]) into where each phase's time went:
//! per (phase, receiving rank), the median of every interval on the path from the sender's
//! kernel through both proxies to the receiver's kernel.
//!
//! Matching: the k-th `send_begin` of a rank and phase is that rank's call k of the phase (the
//! same for every point of its kernels); the proxy's `ring_seen`/`posted` after a `published`
//! belong to it (the ring is FIFO); the receiver's arrivals of a phase are taken in groups of
//! `msgs_per_call` (every call of a phase delivers that many messages to a rank). Written for
//! two ranks, one per node (each rank's peer is the other one), the case the proxy bench runs.

use std::collections::BTreeMap;

use super::stats::{percentile, Summary};
use fabric_ep::abi;
use fabric_ep::trace::TraceRecord;

const PHASES: [&str; 2] = ["dispatch", "combine"];

fn kind(phase: usize, point: u32) -> u16 {
    (phase as u32 * abi::FEP_TRACE_PHASE_STRIDE + point) as u16
}

fn times(recs: &[TraceRecord], rank: u16, k: u16) -> Vec<i64> {
    recs.iter().filter(|r| r.rank == rank && r.kind == k).map(|r| r.t_ns).collect()
}

/// The first record of `rank` and kind `k` at or after `t` (ns), if any.
fn next_after(recs: &[TraceRecord], rank: u16, k: u16, t: i64) -> Option<i64> {
    recs.iter().find(|r| r.rank == rank && r.kind == k && r.t_ns >= t).map(|r| r.t_ns)
}

/// Interval name -> samples (us), per (phase, receiving rank).
pub type Breakdown = BTreeMap<(String, u16), Vec<(String, Vec<f64>)>>;

/// The breakdown of a two-rank trace; `num_experts` decodes the phase of an arrival's counter
/// slot (`(phase * 2 + set) * E + unit`).
pub fn breakdown(recs: &[TraceRecord], num_experts: usize, msgs_per_call: usize) -> Breakdown {
    let mut out = Breakdown::new();
    let e = num_experts.max(1) as u32;
    for (phase, phase_name) in PHASES.iter().enumerate() {
        for me in 0..2u16 {
            let peer = 1 - me;
            let k = |p| kind(phase, p);
            let sb = times(recs, me, k(abi::FEP_TRACE_LL_SEND_BEGIN));
            let st = times(recs, me, k(abi::FEP_TRACE_LL_SEND_STAGED));
            let sp = times(recs, me, k(abi::FEP_TRACE_LL_SEND_PUBLISHED));
            let rb = times(recs, me, k(abi::FEP_TRACE_LL_RECV_BEGIN));
            let rc = times(recs, me, k(abi::FEP_TRACE_LL_RECV_COUNTS));
            let re = times(recs, me, k(abi::FEP_TRACE_LL_RECV_END));
            let peer_sp = times(recs, peer, k(abi::FEP_TRACE_LL_SEND_PUBLISHED));
            let peer_sb = times(recs, peer, k(abi::FEP_TRACE_LL_SEND_BEGIN));
            let arrivals: Vec<i64> = recs
                .iter()
                .filter(|r| {
                    r.rank == me
                        && u32::from(r.kind) == abi::FEP_TRACE_PROXY_ARRIVAL
                        && (r.arg / e) / 2 == phase as u32
                })
                .map(|r| r.t_ns)
                .collect();
            let groups: Vec<i64> = arrivals
                .chunks(msgs_per_call.max(1))
                .filter(|c| c.len() == msgs_per_call.max(1))
                .map(|c| *c.last().expect("non-empty chunk"))
                .collect();
            // The previous phase's end on this rank: the other phase's receive end before it.
            let other_re = times(recs, me, kind(1 - phase, abi::FEP_TRACE_LL_RECV_END));
            let n =
                [sb.len(), sp.len(), rb.len(), rc.len(), re.len(), peer_sp.len(), peer_sb.len()]
                    .into_iter()
                    .min()
                    .unwrap_or(0);
            let mut iv: Vec<(String, Vec<f64>)> = Vec::new();
            let mut push = |name: &str, v: Option<i64>| {
                let Some(v) = v else { return };
                let us = v as f64 / 1e3;
                match iv.iter_mut().find(|(n, _)| n == name) {
                    Some((_, s)) => s.push(us),
                    None => iv.push((name.to_string(), vec![us])),
                }
            };
            for c in 0..n {
                let prev_end = other_re.iter().rev().find(|&&t| t <= sb[c]).copied();
                push(
                    "launch gap (previous phase's receive end -> send begin)",
                    prev_end.map(|t| sb[c] - t),
                );
                push("send: begin -> staging free", st.get(c).map(|t| t - sb[c]));
                push("send: begin -> published", Some(sp[c] - sb[c]));
                push("receive kernel begin - own send published", Some(rb[c] - sp[c]));
                // The peer's commands of this call are the first its proxy sees after the peer's
                // send began (its ring is FIFO and the previous call's batch came before).
                let seen =
                    next_after(recs, peer, abi::FEP_TRACE_PROXY_RING_SEEN as u16, peer_sb[c]);
                let posted = seen
                    .and_then(|t| next_after(recs, peer, abi::FEP_TRACE_PROXY_POSTED as u16, t));
                push(
                    "peer send begin -> peer proxy sees its commands",
                    seen.map(|t| t - peer_sb[c]),
                );
                push(
                    "peer proxy sees the ring -> writes posted",
                    seen.zip(posted).map(|(a, b)| b - a),
                );
                let arrived = groups.get(c).copied();
                push(
                    "writes posted -> last arrival at this proxy",
                    posted.zip(arrived).map(|(a, b)| b - a),
                );
                push("last arrival -> receive kernel has every count", arrived.map(|a| rc[c] - a));
                push("peer published -> receive has every count", Some(rc[c] - peer_sp[c]));
                push("receive: counts -> end (copy / sum)", Some(re[c] - rc[c]));
                push("phase: send begin -> receive end", Some(re[c] - sb[c]));
            }
            out.insert((phase_name.to_string(), me), iv);
        }
    }
    out
}

/// The breakdown as a markdown table (median and p99 per interval, us).
pub fn table(b: &Breakdown) -> String {
    let mut s = String::from(
        "| phase | rank | interval | median us | p99 us | n |\n|---|---|---|---|---|---|\n",
    );
    for ((phase, rank), iv) in b {
        for (name, v) in iv {
            let mut v = v.clone();
            let sm = Summary::of_us(&mut v);
            s.push_str(&format!(
                "| {phase} | {rank} | {name} | {:.2} | {:.2} | {} |\n",
                sm.median_us, sm.p99_us, sm.n
            ));
        }
    }
    s
}

/// Normal mode's proxy-lane chunks (a `FEP_TRACE_NORMAL=1` build, fep_abi.h FEP_TRACE_NP_*):
/// per phase, the intervals one block walks for each chunk, paired within each (rank, block)
/// sequence in time order (a block handles its chunks one after another):
/// - sender: credit wait (`send_wait -> send_stage`), staging + fence + push (`send_stage ->
///   send_pushed`);
/// - receiver (combine: the forwarder): arrival wait (`recv_wait -> recv_copy`), copy-out +
///   credit / flag (`recv_copy -> recv_done`);
///
/// and the proxy's `ring_seen -> posted` (this process's proxy points, in order). Samples in us.
pub fn normal_proxy_spans(recs: &[TraceRecord]) -> Vec<(String, Vec<f64>)> {
    use abi::*;
    let mut out = Vec::new();
    for (phase, name) in PHASES.iter().enumerate() {
        let k = |point: u32| kind(phase, point);
        for (a, b, what) in [
            (FEP_TRACE_NP_SEND_WAIT, FEP_TRACE_NP_SEND_STAGE, "send: credit wait"),
            (FEP_TRACE_NP_SEND_STAGE, FEP_TRACE_NP_SEND_PUSHED, "send: stage + fence + push"),
            (FEP_TRACE_NP_RECV_WAIT, FEP_TRACE_NP_RECV_COPY, "receive: arrival wait"),
            (FEP_TRACE_NP_RECV_COPY, FEP_TRACE_NP_RECV_DONE, "receive: copy out + credit"),
        ] {
            out.push((format!("{name} {what}"), block_spans(recs, k(a), k(b))));
        }
    }
    let seen = FEP_TRACE_PROXY_RING_SEEN as u16;
    let posted = FEP_TRACE_PROXY_POSTED as u16;
    let mut host = Vec::new();
    let mut open: BTreeMap<u16, i64> = BTreeMap::new();
    for r in recs {
        if r.kind == seen {
            open.entry(r.rank).or_insert(r.t_ns);
        } else if r.kind == posted {
            if let Some(t) = open.remove(&r.rank) {
                host.push((r.t_ns - t) as f64 / 1e3);
            }
        }
    }
    out.push(("proxy: ring entries seen -> writes posted".to_string(), host));
    out
}

/// Durations (us) from each `start` record to the next `end` record of the same (rank, arg),
/// records taken in time order; a `start` without its `end` is dropped.
pub fn block_spans(recs: &[TraceRecord], start: u16, end: u16) -> Vec<f64> {
    let mut open: BTreeMap<(u16, u32), i64> = BTreeMap::new();
    let mut v = Vec::new();
    let mut sorted: Vec<&TraceRecord> =
        recs.iter().filter(|r| r.kind == start || r.kind == end).collect();
    sorted.sort_by_key(|r| r.t_ns);
    for r in sorted {
        if r.kind == start {
            open.insert((r.rank, r.arg), r.t_ns);
        } else if let Some(t) = open.remove(&(r.rank, r.arg)) {
            v.push((r.t_ns - t) as f64 / 1e3);
        }
    }
    v
}

/// Spans as a markdown table (n, median, p90 and total per interval, us).
pub fn span_table(spans: &[(String, Vec<f64>)]) -> String {
    let mut s =
        String::from("| interval | n | median us | p90 us | total us |\n|---|---|---|---|---|\n");
    for (name, v) in spans {
        if v.is_empty() {
            s.push_str(&format!("| {name} | 0 | - | - | - |\n"));
            continue;
        }
        let total: f64 = v.iter().sum();
        s.push_str(&format!(
            "| {name} | {} | {:.2} | {:.2} | {:.1} |\n",
            v.len(),
            percentile(v, 50.0),
            percentile(v, 90.0),
            total
        ));
    }
    s
}

/// One line per record from `from` (ns) for `span` ns, times relative to `from` in us.
pub fn timeline(recs: &[TraceRecord], from: i64, span: i64) -> String {
    recs.iter()
        .filter(|r| r.t_ns >= from && r.t_ns < from + span)
        .map(|r| {
            format!(
                "{:>10.2} us  rank {}  {:<28} {}\n",
                (r.t_ns - from) as f64 / 1e3,
                r.rank,
                r.kind_name(),
                r.arg
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(t_ns: i64, kind: u32, rank: u16, arg: u32) -> TraceRecord {
        TraceRecord { t_ns, kind: kind as u16, rank, arg }
    }

    /// Two sender blocks of rank 0 and one receiver block of rank 1 (dispatch), chunks back to
    /// back, interleaved in time: every span pairs within its own block.
    #[test]
    fn normal_proxy_spans_pair_within_each_block() {
        use abi::*;
        let us = 1000;
        let mut r = vec![
            rec(0, FEP_TRACE_NP_SEND_WAIT, 0, 3),
            rec(us, FEP_TRACE_NP_SEND_WAIT, 0, 5),
            rec(2 * us, FEP_TRACE_NP_SEND_STAGE, 0, 3), // block 3 waited 2 us
            rec(4 * us, FEP_TRACE_NP_SEND_STAGE, 0, 5), // block 5 waited 3 us
            rec(9 * us, FEP_TRACE_NP_SEND_PUSHED, 0, 3), // staged 7 us
            rec(10 * us, FEP_TRACE_NP_SEND_WAIT, 0, 3),
            rec(12 * us, FEP_TRACE_NP_SEND_PUSHED, 0, 5), // staged 8 us
            rec(15 * us, FEP_TRACE_NP_SEND_STAGE, 0, 3),  // waited 5 us
            rec(5 * us, FEP_TRACE_NP_RECV_WAIT, 1, 9),
            rec(11 * us, FEP_TRACE_NP_RECV_COPY, 1, 9),
            rec(14 * us, FEP_TRACE_NP_RECV_DONE, 1, 9),
            rec(us, FEP_TRACE_PROXY_RING_SEEN, 0, 1),
            rec(3 * us, FEP_TRACE_PROXY_RING_SEEN, 0, 1), // still the same unposted batch
            rec(4 * us, FEP_TRACE_PROXY_POSTED, 0, 2),
            // A combine-phase point must not pair with dispatch ones.
            rec(16 * us, FEP_TRACE_PHASE_STRIDE + FEP_TRACE_NP_SEND_STAGE, 0, 5),
        ];
        r.sort_by_key(|x| x.t_ns);
        let spans = normal_proxy_spans(&r);
        let get = |name: &str| -> Vec<f64> {
            let mut v = spans.iter().find(|(n, _)| n == name).expect(name).1.clone();
            v.sort_by(|a, b| a.total_cmp(b));
            v
        };
        assert_eq!(get("dispatch send: credit wait"), vec![2.0, 3.0, 5.0]);
        assert_eq!(get("dispatch send: stage + fence + push"), vec![7.0, 8.0]);
        assert_eq!(get("dispatch receive: arrival wait"), vec![6.0]);
        assert_eq!(get("dispatch receive: copy out + credit"), vec![3.0]);
        assert!(get("combine send: credit wait").is_empty());
        assert_eq!(get("proxy: ring entries seen -> writes posted"), vec![3.0]);
        let t = span_table(&spans);
        assert!(t.contains("| dispatch send: credit wait | 3 | 3.00 | 5.00 | 10.0 |"), "{t}");
        assert!(t.contains("| combine send: credit wait | 0 | - | - | - |"), "{t}");
    }

    /// A synthetic dispatch, rank 0 -> rank 1 and back, 1 message each way: every interval
    /// comes out as built.
    #[test]
    fn synthetic_dispatch_breaks_down_as_built() {
        use abi::*;
        let us = 1000;
        let mut r = Vec::new();
        for me in 0..2u16 {
            let off = i64::from(me) * us; // rank 1 starts 1 us later
            r.push(rec(off, FEP_TRACE_LL_SEND_BEGIN, me, 0));
            r.push(rec(off + 2 * us, FEP_TRACE_LL_SEND_STAGED, me, 0));
            r.push(rec(off + 5 * us, FEP_TRACE_LL_SEND_PUBLISHED, me, 0));
            r.push(rec(off + 6 * us, FEP_TRACE_PROXY_RING_SEEN, me, 1));
            r.push(rec(off + 7 * us, FEP_TRACE_PROXY_POSTED, me, 1));
            r.push(rec(off + 8 * us, FEP_TRACE_LL_RECV_BEGIN, me, 0));
        }
        // Arrivals: rank 1 gets rank 0's write at 10 us, rank 0 gets rank 1's at 11 us; slot 0
        // and 1 (E = 2): dispatch.
        r.push(rec(10 * us, FEP_TRACE_PROXY_ARRIVAL, 1, 0));
        r.push(rec(11 * us, FEP_TRACE_PROXY_ARRIVAL, 0, 1));
        r.push(rec(13 * us, FEP_TRACE_LL_RECV_COUNTS, 1, 0));
        r.push(rec(13 * us, FEP_TRACE_LL_RECV_COUNTS, 0, 0));
        r.push(rec(15 * us, FEP_TRACE_LL_RECV_END, 1, 0));
        r.push(rec(15 * us, FEP_TRACE_LL_RECV_END, 0, 0));
        r.sort_by_key(|x| x.t_ns);
        let b = breakdown(&r, 2, 1);
        let get = |rank: u16, name: &str| -> f64 {
            let iv = &b[&("dispatch".to_string(), rank)];
            iv.iter().find(|(n, _)| n.starts_with(name)).map(|(_, v)| v[0]).expect(name)
        };
        assert_eq!(get(1, "send: begin -> published"), 5.0);
        assert_eq!(get(1, "peer send begin -> peer proxy sees"), 6.0);
        assert_eq!(get(1, "writes posted -> last arrival"), 3.0); // rank 0 posted at 7, arrived 10
        assert_eq!(get(1, "last arrival -> receive kernel"), 3.0);
        assert_eq!(get(0, "writes posted -> last arrival"), 3.0); // rank 1 posted at 8, arrived 11
        assert_eq!(get(1, "phase: send begin"), 14.0);
        assert!(b[&("combine".to_string(), 0)].is_empty());
        assert!(table(&b).contains("| dispatch | 1 | send: begin -> published | 5.00 |"));
        assert_eq!(timeline(&r, 0, 2 * us).lines().count(), 2);
    }
}
