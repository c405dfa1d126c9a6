//! Wire format of the TCP store, shared by its client and server.
//!
//! Protocol v2 (all integers little-endian). A frame is `u32 body_len` then the body, `kind: u8`
//! plus a payload; `body_len` is checked against a cap before anything is allocated for it.
//! - rank -> store `HELLO { magic "FEPB", version u32, rank u64, world u64, str (empty),
//!   instance u64, rank_nonce [32] }` (the prefix up to the string is v1's hello, so a v1 store
//!   answers a v2 rank with its version refusal and vice versa);
//!   store -> rank `CHALLENGE { version u32, store_nonce [32] }`, or `REFUSE { VERSION, v u32 }`.
//! - rank -> store `PROOF { hmac [32], job_id str }`; store -> rank `WELCOME { hmac [32] }` (the
//!   store's own proof) once the proof checked and rank 0 opened that instance, or
//!   `REFUSE { code u8, .. }` and a close. Proofs are described in `auth.rs`.
//! - rank -> store `CONTRIBUTE { round u64, timeout_ms u64, data }`; once every rank contributed
//!   to the round, store -> every rank `GATHERED { round u64, world u64 }` followed by `world`
//!   `BLOB { data }` frames in rank order. If the round cannot complete (a rank's connection
//!   dropped, the deadline passed), store -> every waiting rank `FAILED { round u64, code u8, .. }`,
//!   and the instance stays failed: later rounds get the same answer.
//! - store -> every joined rank, at any time: `PEER_GONE { rank u64 }` when a rank's connection
//!   closed, so ranks not inside a collective learn it too.
//! - rank -> store, at any time after joining: `UNRESPONSIVE { count u64, ranks [u64] }`: this
//!   rank is failing because those ranks stopped responding (a bounded wait on them ran out), sent
//!   before it leaves. A stopped process keeps its connection open, so without this the others
//!   would hear only that the reporting rank left. The store holds a report for a short grace
//!   (`REPORT_GRACE`): a named rank that reports too in that time is alive (it waits on someone
//!   else itself) and is dropped from it. Then store -> every joined rank, once per remaining
//!   rank: `PEER_UNRESPONSIVE { rank u64, by u64 }`, and store -> the reporter `REPORTED {}`
//!   (it waits for that before failing, so its own leaving is heard after). A report naming a
//!   rank whose own report is held goes out after that one (`reports.rs`): its reporter hears
//!   of the rank further up the chain before its `REPORTED`. The instance is not
//!   failed by it; ranks' waits on the named rank end naming it.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

pub(super) const MAGIC: [u8; 4] = *b"FEPB";
pub(super) const PROTOCOL_VERSION: u32 = 2;
/// Largest frame body: a full blob plus the contribute header.
pub(super) const MAX_FRAME: usize = super::MAX_BLOB + 64;
/// Largest frame accepted before a connection has proved the secret, so that a stray client
/// cannot make the store buffer much.
pub(super) const HELLO_MAX_FRAME: usize = 4096;
/// Largest frame a rank accepts during the handshake.
pub(super) const REPLY_MAX_FRAME: usize = 64 << 10;
pub(super) const MAX_JOB_ID: usize = 1024;

pub(super) const K_HELLO: u8 = 1;
pub(super) const K_CONTRIBUTE: u8 = 2;
pub(super) const K_WELCOME: u8 = 3;
pub(super) const K_REFUSE: u8 = 4;
pub(super) const K_GATHERED: u8 = 5;
pub(super) const K_BLOB: u8 = 6;
pub(super) const K_FAILED: u8 = 7;
pub(super) const K_CHALLENGE: u8 = 8;
pub(super) const K_PROOF: u8 = 9;
pub(super) const K_PEER_GONE: u8 = 10;
pub(super) const K_UNRESPONSIVE: u8 = 11;
pub(super) const K_PEER_UNRESPONSIVE: u8 = 12;
pub(super) const K_REPORTED: u8 = 13;

/// How long the store holds a report of unresponsive ranks for the named ranks to show they
/// are alive (by reporting themselves).
pub(super) const REPORT_GRACE: std::time::Duration = std::time::Duration::from_millis(300);

pub(super) const REFUSE_JOB: u8 = 1;
pub(super) const REFUSE_WORLD: u8 = 2;
pub(super) const REFUSE_RANGE: u8 = 3;
pub(super) const REFUSE_DUPLICATE: u8 = 4;
pub(super) const REFUSE_VERSION: u8 = 5;
pub(super) const REFUSE_AUTH: u8 = 6;
pub(super) const REFUSE_CLOSED: u8 = 7;

pub(super) const FAIL_TIMEOUT: u8 = 1;
pub(super) const FAIL_GONE: u8 = 2;
// 3 was v1's "a rank was refused": v2 refuses such a rank alone.
pub(super) const FAIL_PROTOCOL: u8 = 4;

/// Appends one frame to `out`.
pub(super) fn put_frame(out: &mut Vec<u8>, kind: u8, payload: &[&[u8]]) {
    let body: usize = 1 + payload.iter().map(|p| p.len()).sum::<usize>();
    // Callers keep bodies under MAX_FRAME (< 4 GiB), so the cast is exact.
    out.extend_from_slice(&(body as u32).to_le_bytes());
    out.push(kind);
    for p in payload {
        out.extend_from_slice(p);
    }
}

pub(super) fn frame(kind: u8, payload: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    put_frame(&mut out, kind, payload);
    out
}

pub(super) fn str_field(s: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + s.len());
    v.extend_from_slice(&(s.len() as u32).to_le_bytes());
    v.extend_from_slice(s.as_bytes());
    v
}

/// A bounds-checked cursor over a received payload.
pub(super) struct Fields<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Fields<'a> {
    pub(super) fn new(buf: &'a [u8], what: &'static str) -> Self {
        Fields { buf, what }
    }
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.buf.len() < n {
            return Err(format!("{} frame is truncated", self.what));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    pub(super) fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(super) fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub(super) fn usize(&mut self) -> Result<usize, String> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| format!("{} frame: {v} does not fit in usize", self.what))
    }
    pub(super) fn string(&mut self) -> Result<String, String> {
        let n = self.u32()? as usize;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    pub(super) fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    pub(super) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
}

/// A rank's HELLO, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Hello {
    pub rank: usize,
    pub world: usize,
    pub instance: u64,
    pub client_nonce: [u8; super::auth::NONCE_LEN],
}

/// Why a HELLO was not taken.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum HelloError {
    /// Not this protocol (magic, truncation, a number past usize): closed without an answer.
    NotOurs,
    /// Our magic with another protocol version: answered with a version refusal.
    Version(u32),
}

/// Parses a HELLO payload (every field bounds-checked; nothing allocated from its numbers).
pub(super) fn parse_hello(payload: &[u8]) -> Result<Hello, HelloError> {
    let mut f = Fields::new(payload, "hello");
    let head = (|| -> Result<_, String> {
        if f.take(4)? != MAGIC {
            return Err("bad magic".into());
        }
        f.u32()
    })();
    let version = head.map_err(|_| HelloError::NotOurs)?;
    if version != PROTOCOL_VERSION {
        return Err(HelloError::Version(version));
    }
    let rest = (|| -> Result<_, String> {
        let (rank, world) = (f.usize()?, f.usize()?);
        let _v1_job_id = f.string()?;
        Ok((rank, world, f.u64()?, f.array::<{ super::auth::NONCE_LEN }>()?))
    })();
    let (rank, world, instance, client_nonce) = rest.map_err(|_| HelloError::NotOurs)?;
    Ok(Hello { rank, world, instance, client_nonce })
}

/// Parses a PROOF payload: the rank's tag and its job id.
pub(super) fn parse_proof(payload: &[u8]) -> Result<([u8; super::auth::MAC_LEN], String), String> {
    let mut f = Fields::new(payload, "proof");
    Ok((f.array::<{ super::auth::MAC_LEN }>()?, f.string()?))
}

/// Parses a CONTRIBUTE payload: round, timeout in ms, the data.
pub(super) fn parse_contribute(payload: &[u8]) -> Result<(u64, u64, &[u8]), String> {
    let mut f = Fields::new(payload, "contribute");
    let (round, timeout_ms) = (f.u64()?, f.u64()?);
    Ok((round, timeout_ms, f.rest()))
}

/// `UNRESPONSIVE`'s ranks: at most `world` of them, each a rank of the job.
pub(super) fn parse_unresponsive(payload: &[u8], world: usize) -> Result<Vec<usize>, String> {
    let mut f = Fields::new(payload, "unresponsive");
    let n = f.usize()?;
    if n > world {
        return Err(format!("unresponsive frame: {n} ranks named in a job of {world}"));
    }
    let mut ranks = Vec::with_capacity(n);
    for _ in 0..n {
        let r = f.usize()?;
        if r >= world {
            return Err(format!("unresponsive frame: rank {r} in a job of {world}"));
        }
        ranks.push(r);
    }
    if !f.is_empty() {
        return Err("unresponsive frame: bytes after its ranks".into());
    }
    Ok(ranks)
}

/// Splits complete frames off the front of `buf`; leaves a partial one in place.
pub(super) fn split_frames(
    buf: &mut Vec<u8>,
    max_body: usize,
) -> Result<Vec<(u8, Vec<u8>)>, String> {
    let mut frames = Vec::new();
    let mut pos = 0;
    while buf.len() - pos >= 4 {
        let mut h = [0u8; 4];
        h.copy_from_slice(&buf[pos..pos + 4]);
        let len = u32::from_le_bytes(h) as usize;
        if len == 0 || len > max_body {
            return Err(format!("frame length {len} is outside 1..={max_body}"));
        }
        if buf.len() - pos - 4 < len {
            break;
        }
        frames.push((buf[pos + 4], buf[pos + 5..pos + 4 + len].to_vec()));
        pos += 4 + len;
    }
    buf.drain(..pos);
    Ok(frames)
}

/// Why a blocking frame read or write stopped.
pub(super) enum Wire {
    TimedOut,
    Closed(io::Error),
    Bad(String),
}

fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

pub(super) fn write_all_by(
    stream: &TcpStream,
    mut buf: &[u8],
    deadline: Instant,
) -> Result<(), Wire> {
    let mut stream = stream;
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Wire::TimedOut);
        }
        stream.set_write_timeout(Some(left)).map_err(Wire::Closed)?;
        match stream.write(buf) {
            Ok(0) => return Err(Wire::Closed(io::ErrorKind::WriteZero.into())),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => return Err(Wire::TimedOut),
            Err(e) => return Err(Wire::Closed(e)),
        }
    }
    Ok(())
}

/// Fills `buf` by `deadline`, or with no bound at all when `deadline` is `None` (the client's
/// reader thread, which a shutdown of the socket wakes).
fn read_exact_by(
    stream: &TcpStream,
    mut buf: &mut [u8],
    deadline: Option<Instant>,
) -> Result<(), Wire> {
    let mut stream = stream;
    while !buf.is_empty() {
        let wait = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Wire::TimedOut);
                }
                Some(left)
            }
            None => None,
        };
        stream.set_read_timeout(wait).map_err(Wire::Closed)?;
        match stream.read(buf) {
            Ok(0) => return Err(Wire::Closed(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) && deadline.is_some() => return Err(Wire::TimedOut),
            Err(e) if timed_out(&e) => {}
            Err(e) => return Err(Wire::Closed(e)),
        }
    }
    Ok(())
}

/// Reads one frame, refusing a length above `max_body` before allocating anything for it, and
/// growing the buffer only as bytes actually arrive.
pub(super) fn read_frame(
    stream: &TcpStream,
    deadline: Option<Instant>,
    max_body: usize,
) -> Result<(u8, Vec<u8>), Wire> {
    let mut h = [0u8; 4];
    read_exact_by(stream, &mut h, deadline)?;
    let len = u32::from_le_bytes(h) as usize;
    if len == 0 || len > max_body {
        return Err(Wire::Bad(format!("frame length {len} is outside 1..={max_body}")));
    }
    let mut body = Vec::new();
    while body.len() < len {
        let old = body.len();
        body.resize(old + (len - old).min(1 << 20), 0);
        read_exact_by(stream, &mut body[old..], deadline)?;
    }
    let payload = body.split_off(1);
    Ok((body[0], payload))
}

/// How long a silent peer host may take to be declared dead by TCP keepalive: probes after
/// `KEEPALIVE_IDLE` of silence, then `KEEPALIVE_COUNT` unanswered probes `KEEPALIVE_INTERVAL`
/// apart. A killed process closes its socket at once; this covers a host that vanished (power,
/// kernel panic, network cut), which would otherwise look alive until the collective's timeout.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
const KEEPALIVE_COUNT: libc::c_int = 5;

/// Turns on TCP keepalive with the bounds above. Best effort: a socket that refuses still works,
/// it only learns of a vanished host later.
pub(super) fn keepalive(stream: &TcpStream) {
    let fd = stream.as_raw_fd();
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| {
        // SAFETY: `fd` is an open socket owned by `stream` for the duration of the call, and the
        // option value is a live `c_int` whose size is passed alongside.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, KEEPALIVE_IDLE.as_secs() as libc::c_int);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, KEEPALIVE_INTERVAL.as_secs() as libc::c_int);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, KEEPALIVE_COUNT);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_frames_checks_lengths() {
        let mut buf = frame(K_BLOB, &[b"abc"]);
        buf.extend_from_slice(&frame(K_BLOB, &[b""]));
        buf.extend_from_slice(&[9, 0]); // partial header stays
        let frames = split_frames(&mut buf, 16).expect("frames");
        assert_eq!(frames, vec![(K_BLOB, b"abc".to_vec()), (K_BLOB, vec![])]);
        assert_eq!(buf, vec![9, 0]);
        let mut huge = u32::MAX.to_le_bytes().to_vec();
        assert!(split_frames(&mut huge, MAX_FRAME).is_err());
        let mut empty = 0u32.to_le_bytes().to_vec();
        assert!(split_frames(&mut empty, MAX_FRAME).is_err());
    }

    #[test]
    fn fields_reject_truncation() {
        let mut f = Fields::new(&[1, 2, 3], "test");
        assert!(f.u64().is_err());
        let mut f = Fields::new(&[255, 255, 255, 255], "test");
        assert!(f.string().is_err(), "a string length beyond the payload must not allocate");
        let mut f = Fields::new(&[7; 31], "test");
        assert!(f.array::<32>().is_err());
    }
}
