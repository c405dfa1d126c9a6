//! Fabric-level runners: an all-to-all self-test of RMA writes with immediate data (every byte
//! and completion checked), RMA bandwidth/latency between two ranks, and Debian's `fi_pingpong`
//! on the same provider for comparison.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::fabric::{Completion, FiAddr, InfoQuery, MemKind, MemoryRegion, RemoteRegion, Stack};
use crate::util::Deadline;

const EMPTY: Completion = Completion { context: 0, flags: 0, len: 0, data: 0 };

/// A connected group: every rank's address and receive-region descriptor.
pub struct Peers {
    pub addrs: Vec<FiAddr>,
    pub regions: Vec<RemoteRegion>,
}

/// All-gathers endpoint names and one region descriptor per rank, and fills the AV.
pub fn connect(boot: &dyn Bootstrap, stack: &Stack, region: &MemoryRegion) -> Result<Peers> {
    let name = stack.ep.name()?;
    let desc = region.remote().to_bytes();
    let mut blob = (name.len() as u32).to_le_bytes().to_vec();
    blob.extend_from_slice(&name);
    blob.extend_from_slice(&desc);
    let all = boot.all_gather(&blob)?;
    let mut names = Vec::with_capacity(all.len());
    let mut regions = Vec::with_capacity(all.len());
    for (r, b) in all.iter().enumerate() {
        let bad = || Error::Protocol {
            rank: boot.rank(),
            peer: r,
            phase: "connect",
            msg: format!("malformed connection blob of {} bytes", b.len()),
        };
        let n = u32::from_le_bytes(b.get(..4).ok_or_else(bad)?.try_into().map_err(|_| bad())?)
            as usize;
        names.push(b.get(4..4 + n).ok_or_else(bad)?.to_vec());
        regions.push(RemoteRegion::from_bytes(b.get(4 + n..).ok_or_else(bad)?).map_err(|_| bad())?);
    }
    Ok(Peers { addrs: stack.connect(&names)?, regions })
}

/// The byte every all-to-all message carries at position `i`: distinct per (src, dst, i).
pub fn pattern(src: usize, dst: usize, i: usize) -> u8 {
    (src.wrapping_mul(131) ^ dst.wrapping_mul(31) ^ i.wrapping_mul(7) ^ (i >> 9)) as u8
}

/// Outcome of [`alltoall_selftest`].
#[derive(Debug)]
pub struct AllToAllReport {
    pub elapsed: Duration,
    pub writes_posted: usize,
    pub arrivals_per_source: Vec<usize>,
}

/// Every rank writes `bytes_per_peer` bytes to every other rank as `msgs_per_peer` RMA writes
/// with immediate data (`src_rank << 8 | msg`), in a random-ish order, then waits (bounded by
/// `timeout`) for all its local completions and for `msgs_per_peer` arrivals from each source,
/// and checks every byte. A source that does not deliver is named in the error.
///
/// `die_after_connect` makes this rank return right after connecting (failure tests).
pub fn alltoall_selftest(
    boot: &dyn Bootstrap,
    provider: &str,
    bytes_per_peer: usize,
    msgs_per_peer: usize,
    timeout: Duration,
) -> Result<AllToAllReport> {
    let (rank, world) = (boot.rank(), boot.world_size());
    if msgs_per_peer == 0 || msgs_per_peer > 256 || bytes_per_peer % msgs_per_peer != 0 {
        return Err(Error::arg("msgs_per_peer", "must be 1..=256 and divide bytes_per_peer"));
    }
    let total = bytes_per_peer * world;
    let mut send: Vec<u8> = vec![0; total.max(1)];
    let mut recv: Vec<u8> = vec![0xEE; total.max(1)];
    let stack = Stack::open(&InfoQuery::provider(provider), world)?;
    for dst in 0..world {
        for i in 0..bytes_per_peer {
            send[dst * bytes_per_peer + i] = pattern(rank, dst, i);
        }
    }
    // SAFETY: `send`/`recv` are declared before `stack` and the regions, so on every return
    // path the endpoint and regions are closed before the vectors are freed.
    let smr = unsafe { stack.register(send.as_mut_ptr(), send.len(), MemKind::Host)? };
    let rmr = unsafe { stack.register(recv.as_mut_ptr(), recv.len(), MemKind::Host)? };
    let peers = connect(boot, &stack, &rmr)?;
    boot.barrier()?;
    if std::env::var("FEP_TEST_DIE_RANK").ok().and_then(|v| v.parse().ok()) == Some(rank) {
        // Failure test: this rank vanishes after connecting, before writing anything.
        std::process::exit(3);
    }

    let start = Instant::now();
    let deadline = Deadline::after(timeout);
    let msg = bytes_per_peer / msgs_per_peer;
    // Order: message-major, destinations rotated per rank, so arrivals interleave.
    let mut todo = Vec::new();
    for m in 0..msgs_per_peer {
        for k in 1..world {
            todo.push(((rank + k) % world, m));
        }
    }
    let mut arrivals = vec![0usize; world];
    arrivals[rank] = msgs_per_peer;
    recv[rank * bytes_per_peer..(rank + 1) * bytes_per_peer]
        .copy_from_slice(&send[rank * bytes_per_peer..(rank + 1) * bytes_per_peer]);
    let mut local_done = 0usize;
    let mut next = 0usize;
    let mut buf = [EMPTY; 64];
    let expected_local = todo.len();
    while next < todo.len()
        || local_done < expected_local
        || arrivals.iter().any(|&a| a < msgs_per_peer)
    {
        if next < todo.len() {
            let (dst, m) = todo[next];
            let off = dst * bytes_per_peer + m * msg;
            let roff = (rank * bytes_per_peer + m * msg) as u64;
            let imm = ((rank as u64) << 8) | m as u64;
            // SAFETY: send/recv regions stay registered until all local completions are read
            // (loop condition), and the peer's region until its barrier below.
            let posted = unsafe {
                stack.ep.try_write(
                    &smr,
                    off,
                    msg,
                    peers.addrs[dst],
                    &peers.regions[dst],
                    roff,
                    Some(imm),
                    dst as u64 + 1,
                )
            }
            .map_err(|e| Error::Other(format!("rank {rank}: write to rank {dst}: {e}")))?;
            if posted {
                next += 1;
            }
        }
        let n = stack.cq.read(&mut buf).map_err(|e| match e {
            crate::fabric::FabricError::Completion { op_context, .. } if op_context > 0 => {
                Error::Other(format!("rank {rank}: write to rank {} failed: {e}", op_context - 1))
            }
            e => e.into(),
        })?;
        for c in &buf[..n] {
            if c.has_data() {
                let src = (c.data >> 8) as usize;
                if src >= world || (c.data & 0xff) as usize >= msgs_per_peer {
                    return Err(Error::Protocol {
                        rank,
                        peer: src,
                        phase: "alltoall",
                        msg: format!("immediate {:#x} out of range", c.data),
                    });
                }
                arrivals[src] += 1;
            } else if c.is_local_tx() {
                local_done += 1;
            }
        }
        if deadline.expired() {
            let mut peers_missing: Vec<usize> =
                (0..world).filter(|&s| arrivals[s] < msgs_per_peer).collect();
            if local_done < expected_local && peers_missing.is_empty() {
                peers_missing = (0..world).filter(|&d| d != rank).collect();
            }
            return Err(Error::Timeout {
                rank,
                phase: "alltoall: waiting for RMA writes with immediate data",
                peers: peers_missing,
                waited: deadline.elapsed(),
            });
        }
    }
    let elapsed = start.elapsed();
    for src in 0..world {
        for i in 0..bytes_per_peer {
            let got = recv[src * bytes_per_peer + i];
            if got != pattern(src, rank, i) {
                return Err(Error::Protocol {
                    rank,
                    peer: src,
                    phase: "alltoall",
                    msg: format!("byte {i}: got {got:#x}, want {:#x}", pattern(src, rank, i)),
                });
            }
        }
    }
    // NOTES: peers may still be writing into *their* peers; nobody writes into us any more
    // (all arrivals are in), but we keep our regions until everyone is done, so no peer's
    // in-flight write can target a closed region.
    boot.barrier()?;
    drop((smr, rmr));
    Ok(AllToAllReport { elapsed, writes_posted: expected_local, arrivals_per_source: arrivals })
}

/// One row of the fabric benchmark.
#[derive(Clone, Debug, Default)]
pub struct FabricRow {
    pub bytes: usize,
    /// Streaming RMA writes with immediate data (a window in flight), MB/s (1e6 bytes/s).
    pub stream_mbps: f64,
    /// RMA-write ping-pong (each side waits for the other's write), MB/s as fi_pingpong counts.
    pub pingpong_mbps: f64,
    /// Half round trip of the RMA ping-pong, microseconds.
    pub pingpong_us: f64,
}

/// Waits for one remote-data completion; also counts local completions seen on the way.
fn wait_data(stack: &Stack, deadline: &Deadline, local: &mut usize, what: &str) -> Result<u64> {
    let mut buf = [EMPTY; 1];
    loop {
        if stack.cq.read(&mut buf)? == 1 {
            if buf[0].has_data() {
                return Ok(buf[0].data);
            }
            *local += 1;
        } else if deadline.expired() {
            return Err(Error::Other(format!("fabric bench: timed out waiting for {what}")));
        }
    }
}

/// Ranks 0 and 1 measure RMA writes between them (other ranks only join the rendezvous).
/// Returns rows on rank 0, an empty vector elsewhere.
pub fn rma_bench(
    boot: &dyn Bootstrap,
    provider: &str,
    sizes: &[usize],
    iters: usize,
    window: usize,
) -> Result<Vec<FabricRow>> {
    let rank = boot.rank();
    if boot.world_size() < 2 {
        return Err(Error::arg("ranks", "the fabric benchmark needs 2 ranks"));
    }
    let max = sizes.iter().copied().max().unwrap_or(8).max(8);
    // Buffers before the stack: on every return path they outlive the endpoint and regions.
    let mut src: Vec<u8> = (0..max).map(|i| i as u8).collect();
    let mut dst = vec![0u8; max];
    let stack = Stack::open(&InfoQuery::provider(provider), boot.world_size())?;
    let smr = unsafe { stack.register(src.as_mut_ptr(), max, MemKind::Host)? };
    let rmr = unsafe { stack.register(dst.as_mut_ptr(), max, MemKind::Host)? };
    let peers = connect(boot, &stack, &rmr)?;
    boot.barrier()?;
    let mut rows = Vec::new();
    if rank < 2 {
        let peer = 1 - rank;
        let deadline = Deadline::after(Duration::from_secs(120));
        let mut local = 0usize;
        for &size in sizes {
            let post = |ctx: u64, imm: u64| unsafe {
                stack.ep.write(
                    &smr,
                    0,
                    size,
                    peers.addrs[peer],
                    &peers.regions[peer],
                    0,
                    Some(imm),
                    ctx,
                    deadline,
                )
            };
            // Ping-pong: warm-up then timed.
            let warm = (iters / 10).max(2);
            let mut t0 = Instant::now();
            for i in 0..warm + iters {
                if i == warm {
                    t0 = Instant::now();
                }
                if rank == 0 {
                    post(1, 1)?;
                    wait_data(&stack, &deadline, &mut local, "the pong")?;
                } else {
                    wait_data(&stack, &deadline, &mut local, "the ping")?;
                    post(1, 1)?;
                }
            }
            let pp = t0.elapsed();
            // Streaming: `window` writes in flight; the receiver acks once all have arrived.
            let n = iters.max(window);
            boot.barrier()?;
            let t1 = Instant::now();
            if rank == 0 {
                let mut posted = 0usize;
                let mut done = 0usize;
                let mut buf = [EMPTY; 64];
                while done < n {
                    while posted < n && posted - done < window {
                        let ok = unsafe {
                            stack.ep.try_write(
                                &smr,
                                0,
                                size,
                                peers.addrs[peer],
                                &peers.regions[peer],
                                0,
                                Some(2),
                                2,
                            )?
                        };
                        if !ok {
                            break;
                        }
                        posted += 1;
                    }
                    let k = stack.cq.read(&mut buf)?;
                    done += buf[..k].iter().filter(|c| c.is_local_tx()).count();
                    if deadline.expired() {
                        return Err(Error::Other("fabric bench: stream timed out".into()));
                    }
                }
                wait_data(&stack, &deadline, &mut local, "the stream ack")?;
            } else {
                for _ in 0..n {
                    wait_data(&stack, &deadline, &mut local, "stream data")?;
                }
                post(3, 3)?;
            }
            let st = t1.elapsed();
            // Drain the local completions of the ping-pong/ack writes before reusing buffers.
            boot.barrier()?;
            let mut buf = [EMPTY; 64];
            while stack.cq.read(&mut buf)? > 0 {}
            rows.push(FabricRow {
                bytes: size,
                stream_mbps: (n * size) as f64 / st.as_secs_f64() / 1e6,
                pingpong_mbps: (2 * iters * size) as f64 / pp.as_secs_f64() / 1e6,
                pingpong_us: pp.as_secs_f64() * 1e6 / (2 * iters) as f64,
            });
        }
    }
    boot.barrier()?;
    drop((smr, rmr));
    Ok(if rank == 0 { rows } else { Vec::new() })
}

/// Result of one `fi_pingpong` run.
#[derive(Clone, Copy, Debug, Default)]
pub struct PingpongRow {
    pub mbps: f64,
    pub usec_per_xfer: f64,
}

/// Runs Debian's `fi_pingpong` (server and client on this machine) for one size.
pub fn fi_pingpong(provider: &str, size: usize, iters: usize) -> Result<PingpongRow> {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")
            .map_err(|e| Error::Other(format!("picking a port for fi_pingpong: {e}")))?;
        l.local_addr().map_err(|e| Error::Other(e.to_string()))?.port()
    };
    let common = |c: &mut Command| {
        c.args(["-p", provider, "-e", "rdm", "-I", &iters.to_string(), "-S", &size.to_string()])
            .args(["-B", &port.to_string()])
            .stdin(Stdio::null());
    };
    let mut server = Command::new("fi_pingpong");
    common(&mut server);
    let mut server = server
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| Error::Other(format!("fi_pingpong not runnable (apt-get install libfabric-bin): {e}")))?;
    std::thread::sleep(Duration::from_millis(300));
    let mut client = Command::new("fi_pingpong");
    client.args(["-p", provider, "-e", "rdm", "-I", &iters.to_string(), "-S", &size.to_string()]);
    client.args(["-P", &port.to_string(), "127.0.0.1"]).stdin(Stdio::null());
    let out = run_with_timeout(client, Duration::from_secs(60));
    let _ = server.kill();
    let _ = server.wait();
    let out = out?;
    parse_pingpong(&out).ok_or_else(|| Error::Other(format!("could not parse fi_pingpong output:\n{out}")))
}

fn run_with_timeout(mut cmd: Command, limit: Duration) -> Result<String> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::Other(format!("spawning fi_pingpong: {e}")))?;
    let deadline = Deadline::after(limit);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if deadline.expired() => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Other(format!("fi_pingpong did not finish in {limit:?}")));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(Error::Other(format!("waiting for fi_pingpong: {e}"))),
        }
    }
    let out = child.wait_with_output().map_err(|e| Error::Other(e.to_string()))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

/// Parses the last data line of `fi_pingpong`'s table
/// (`bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec`).
pub fn parse_pingpong(out: &str) -> Option<PingpongRow> {
    let line = out.lines().rev().find(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() == 8 && f[5].parse::<f64>().is_ok()
    })?;
    let f: Vec<&str> = line.split_whitespace().collect();
    Some(PingpongRow { mbps: f[5].parse().ok()?, usec_per_xfer: f[6].parse().ok()? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fi_pingpong_table() {
        let out = "bytes   #sent   #ack     total       time     MB/sec    usec/xfer   Mxfers/sec\n\
                   64k     1k      =1k      125m        0.01s  10327.95       6.35       0.16\n";
        let r = parse_pingpong(out).unwrap();
        assert_eq!((r.mbps, r.usec_per_xfer), (10327.95, 6.35));
        assert!(parse_pingpong("garbage").is_none());
    }
}
