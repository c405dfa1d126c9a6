//! The TCP store: rank 0 serves, every rank (rank 0 included) is a client.
//!
//! Protocol (all integers little-endian). A frame is `u32 body_len` then the body, `kind: u8` plus a
//! payload; `body_len` is checked against a cap before anything is allocated for it.
//! - client -> store `HELLO { magic "FEPB", version u32, rank u64, world u64, job_id str }`;
//!   store -> client `WELCOME { version u32 }` or `REFUSE { code u8, .. }` and a close.
//! - client -> store `CONTRIBUTE { round u64, timeout_ms u64, data }`; once every rank contributed
//!   to the round, store -> every rank `GATHERED { round u64, world u64 }` followed by `world`
//!   `BLOB { data }` frames in rank order. If the round cannot complete (a rank's connection
//!   dropped, the deadline passed, a rank was refused), store -> every waiting rank
//!   `FAILED { round u64, code u8, .. }`, and the store stays failed: later rounds get the same answer.
//!
//! The store is one thread with `poll(2)` over non-blocking sockets (no thread per rank, so a few
//! thousand ranks cost file descriptors, not threads). Clients use blocking sockets whose timeouts
//! are re-armed from the deadline before every read and write.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{check_ranks, later, Bootstrap, BootstrapError, MAX_BLOB, MAX_WORLD};

const MAGIC: [u8; 4] = *b"FEPB";
const PROTOCOL_VERSION: u32 = 1;
/// Largest frame body: a full blob plus the contribute header.
const MAX_FRAME: usize = MAX_BLOB + 64;
/// Largest frame accepted before a connection has said a valid hello, so that a stray client
/// cannot make the store buffer much.
const HELLO_MAX_FRAME: usize = 4096;
/// Largest frame a client accepts as the answer to its hello.
const REPLY_MAX_FRAME: usize = 64 << 10;
const MAX_JOB_ID: usize = 1024;
/// Extra time a client gives the store beyond its own deadline to deliver the store's verdict
/// (the store's round deadline is never later than this client's, so normally it answers first).
const ANSWER_GRACE: Duration = Duration::from_secs(2);
/// How long a stopping store keeps flushing answers already queued (a final round's result to
/// ranks slower than rank 0) before it closes the sockets.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

const K_HELLO: u8 = 1;
const K_CONTRIBUTE: u8 = 2;
const K_WELCOME: u8 = 3;
const K_REFUSE: u8 = 4;
const K_GATHERED: u8 = 5;
const K_BLOB: u8 = 6;
const K_FAILED: u8 = 7;

const REFUSE_JOB: u8 = 1;
const REFUSE_WORLD: u8 = 2;
const REFUSE_RANGE: u8 = 3;
const REFUSE_DUPLICATE: u8 = 4;
const REFUSE_VERSION: u8 = 5;

const FAIL_TIMEOUT: u8 = 1;
const FAIL_GONE: u8 = 2;
const FAIL_REFUSED: u8 = 3;
const FAIL_PROTOCOL: u8 = 4;

/// Everything a [`TcpStore`] needs; [`TcpStoreOptions::from_env`] fills it from launcher env vars.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpStoreOptions {
    /// Host of rank 0 (`MASTER_ADDR`): a name or an IP literal.
    pub addr: String,
    /// Port of the store (`FEP_MASTER_PORT`, else `MASTER_PORT + 1`).
    pub port: u16,
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Peers presenting another job id are refused (`FEP_JOB_ID`, else `TORCHELASTIC_RUN_ID`,
    /// else `"none"`).
    pub job_id: String,
    /// Bound on construction (connect + hello) and on each all-gather.
    pub timeout: Duration,
}

impl TcpStoreOptions {
    /// Reads `MASTER_ADDR`, `MASTER_PORT` (the store listens on `MASTER_PORT + 1`, or on
    /// `FEP_MASTER_PORT` when set), `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK` and `LOCAL_WORLD_SIZE` (these two default to `RANK` and `WORLD_SIZE`, i.e. one
    /// node), and the job id from `FEP_JOB_ID`, else `TORCHELASTIC_RUN_ID`, else `"none"`.
    ///
    /// Under torchrun the agent's own store already listens on `MASTER_PORT`, hence the `+ 1`;
    /// `FEP_MASTER_PORT` picks any other port.
    pub fn from_env(timeout: Duration) -> Result<Self, BootstrapError> {
        Self::from_lookup(
            |k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned()),
            timeout,
        )
    }

    /// [`from_env`](Self::from_env) over any variable source (tests, config files).
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
        timeout: Duration,
    ) -> Result<Self, BootstrapError> {
        let get = |k: &str| get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let required = |var: &'static str| {
            get(var).ok_or_else(|| BootstrapError::Env {
                var,
                msg: "not set; torchrun, Kubeflow's PyTorchJob and `ep-bench --ranks N` set it, \
                      otherwise export it"
                    .into(),
            })
        };
        let number = |var: &'static str, v: String| {
            v.parse::<usize>().map_err(|_| BootstrapError::Env {
                var,
                msg: format!("'{v}' is not a non-negative integer"),
            })
        };
        let addr = required("MASTER_ADDR")?;
        let (port_var, port_str) = match get("FEP_MASTER_PORT") {
            Some(p) => ("FEP_MASTER_PORT", p),
            None => ("MASTER_PORT", required("MASTER_PORT")?),
        };
        // NOTES: under torchrun (and any job that calls torch.distributed.init_process_group)
        // a torch TCPStore already listens on MASTER_PORT, so without FEP_MASTER_PORT the
        // fabric-ep store takes the next port.
        let bump = u16::from(port_var == "MASTER_PORT");
        let port = match port_str.parse::<u16>().ok().and_then(|p| p.checked_add(bump)) {
            Some(p) if p != bump => p,
            _ => {
                return Err(BootstrapError::Env {
                    var: port_var,
                    msg: format!("'{port_str}' is not a TCP port (1..=65535)"),
                })
            }
        };
        let rank = number("RANK", required("RANK")?)?;
        let world_size = number("WORLD_SIZE", required("WORLD_SIZE")?)?;
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => number("LOCAL_RANK", v)?,
            None => rank,
        };
        let local_world_size = match get("LOCAL_WORLD_SIZE") {
            Some(v) => number("LOCAL_WORLD_SIZE", v)?,
            None => world_size,
        };
        let job_id = get("FEP_JOB_ID")
            .or_else(|| get("TORCHELASTIC_RUN_ID"))
            .unwrap_or_else(|| "none".to_string());
        let env = |var: &'static str, msg: String| Err(BootstrapError::Env { var, msg });
        if world_size == 0 || world_size > MAX_WORLD {
            return env("WORLD_SIZE", format!("{world_size} is not in 1..={MAX_WORLD}"));
        }
        if rank >= world_size {
            return env("RANK", format!("{rank} is out of range for WORLD_SIZE={world_size}"));
        }
        if local_world_size == 0 || local_world_size > world_size {
            return env(
                "LOCAL_WORLD_SIZE",
                format!("{local_world_size} is not in 1..=WORLD_SIZE ({world_size})"),
            );
        }
        if local_rank >= local_world_size {
            return env(
                "LOCAL_RANK",
                format!("{local_rank} is out of range for LOCAL_WORLD_SIZE={local_world_size}"),
            );
        }
        if job_id.len() > MAX_JOB_ID {
            return env("FEP_JOB_ID", format!("longer than {MAX_JOB_ID} bytes"));
        }
        Ok(TcpStoreOptions {
            addr,
            port,
            rank,
            world_size,
            local_rank,
            local_world_size,
            job_id,
            timeout,
        })
    }

    /// `host:port` as it appears in error messages (IPv6 literals bracketed).
    pub fn store_addr(&self) -> String {
        if self.addr.contains(':') {
            format!("[{}]:{}", self.addr, self.port)
        } else {
            format!("{}:{}", self.addr, self.port)
        }
    }

    fn validate(&self) -> Result<(), BootstrapError> {
        check_ranks(self.rank, self.world_size, self.local_rank, self.local_world_size)?;
        if self.addr.is_empty() {
            return Err(BootstrapError::Config("store address is empty".into()));
        }
        if self.job_id.len() > MAX_JOB_ID {
            return Err(BootstrapError::Config(format!(
                "job id is {} bytes, the limit is {MAX_JOB_ID}",
                self.job_id.len()
            )));
        }
        Ok(())
    }
}

/// [`Bootstrap`] over a TCP store served by rank 0.
///
/// Construction returns once this rank's hello was accepted (rank 0 also starts the store first);
/// it does not wait for the other ranks: the first collective does, bounded by the timeout.
pub struct TcpStore {
    opts: TcpStoreOptions,
    addr: String,
    // NOTES: field order is drop order: this rank's connection closes before rank 0 stops its store.
    client: Mutex<Client>,
    server: Option<StoreServer>,
}

impl TcpStore {
    /// [`TcpStoreOptions::from_env`] then [`TcpStore::new`].
    pub fn from_env(timeout: Duration) -> Result<Self, BootstrapError> {
        Self::new(TcpStoreOptions::from_env(timeout)?)
    }

    /// Joins the store at `opts.addr:opts.port`, starting it first when `opts.rank == 0`. Other
    /// ranks retry connecting until the timeout, since rank 0 may start late.
    pub fn new(opts: TcpStoreOptions) -> Result<Self, BootstrapError> {
        opts.validate()?;
        let deadline = later(Instant::now(), opts.timeout);
        let addr = opts.store_addr();
        let server = if opts.rank == 0 {
            let listener = bind_store(&opts.addr, opts.port)?;
            Some(StoreServer::start(
                listener,
                opts.job_id.clone(),
                opts.world_size,
                opts.timeout,
                &addr,
            )?)
        } else {
            None
        };
        let stream = connect_until(&opts.addr, opts.port, &addr, deadline)?;
        let mut client = Client { stream, next_round: 0, broken: None };
        let fatal = server.as_ref().map(|s| Arc::clone(&s.fatal));
        client.hello(&opts, &addr, deadline, fatal.as_deref())?;
        Ok(TcpStore { opts, addr, client: Mutex::new(client), server })
    }

    /// The job id this rank presented.
    pub fn job_id(&self) -> &str {
        &self.opts.job_id
    }

    /// `host:port` of the store.
    pub fn store_addr(&self) -> &str {
        &self.addr
    }

    /// The bound on each collective.
    pub fn timeout(&self) -> Duration {
        self.opts.timeout
    }

    /// Closes this rank's connection and, on rank 0, stops the store (after flushing answers
    /// already queued, bounded). Dropping does the same; this form reports a store that failed.
    pub fn close(mut self) -> Result<(), BootstrapError> {
        if let Err(e) = self.client.get_mut().stream.shutdown(std::net::Shutdown::Both) {
            if e.kind() != io::ErrorKind::NotConnected {
                return Err(BootstrapError::Io {
                    call: "shutdown",
                    addr: self.addr.clone(),
                    source: e,
                });
            }
        }
        if let Some(mut server) = self.server.take() {
            server.stop();
            if let Some(msg) = server.fatal.lock().clone() {
                return Err(BootstrapError::Protocol(format!("the store thread failed: {msg}")));
            }
        }
        Ok(())
    }

    fn gather(&self, data: &[u8], op: &'static str) -> Result<Vec<Vec<u8>>, BootstrapError> {
        if data.len() > MAX_BLOB {
            return Err(BootstrapError::Protocol(format!(
                "rank {}: {op} blob of {} bytes exceeds the {MAX_BLOB}-byte limit",
                self.opts.rank,
                data.len()
            )));
        }
        let fatal = self.server.as_ref().map(|s| Arc::clone(&s.fatal));
        let mut client = self.client.lock();
        client.gather(&self.opts, &self.addr, data, op, fatal.as_deref())
    }
}

impl Bootstrap for TcpStore {
    fn rank(&self) -> usize {
        self.opts.rank
    }
    fn world_size(&self) -> usize {
        self.opts.world_size
    }
    fn local_rank(&self) -> usize {
        self.opts.local_rank
    }
    fn local_world_size(&self) -> usize {
        self.opts.local_world_size
    }
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        self.gather(data, "all_gather")
    }
    fn barrier(&self) -> Result<(), BootstrapError> {
        self.gather(&[], "barrier").map(|_| ())
    }
}

// ---------------------------------------------------------------------------------------------
// Framing

/// Appends one frame to `out`.
fn put_frame(out: &mut Vec<u8>, kind: u8, payload: &[&[u8]]) {
    let body: usize = 1 + payload.iter().map(|p| p.len()).sum::<usize>();
    // Callers keep bodies under MAX_FRAME (< 4 GiB), so the cast is exact.
    out.extend_from_slice(&(body as u32).to_le_bytes());
    out.push(kind);
    for p in payload {
        out.extend_from_slice(p);
    }
}

fn frame(kind: u8, payload: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    put_frame(&mut out, kind, payload);
    out
}

fn str_field(s: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + s.len());
    v.extend_from_slice(&(s.len() as u32).to_le_bytes());
    v.extend_from_slice(s.as_bytes());
    v
}

/// A bounds-checked cursor over a received payload.
struct Fields<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Fields<'a> {
    fn new(buf: &'a [u8], what: &'static str) -> Self {
        Fields { buf, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.buf.len() < n {
            return Err(format!("{} frame is truncated", self.what));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn usize(&mut self) -> Result<usize, String> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| format!("{} frame: {v} does not fit in usize", self.what))
    }
    fn string(&mut self) -> Result<String, String> {
        let n = self.u32()? as usize;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
}

/// Splits complete frames off the front of `buf`; leaves a partial one in place.
fn split_frames(buf: &mut Vec<u8>, max_body: usize) -> Result<Vec<(u8, Vec<u8>)>, String> {
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

// ---------------------------------------------------------------------------------------------
// Client side

/// Why a blocking frame read or write stopped.
enum Wire {
    TimedOut,
    Closed(io::Error),
    Bad(String),
}

fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

fn write_all_by(stream: &mut TcpStream, mut buf: &[u8], deadline: Instant) -> Result<(), Wire> {
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

fn read_exact_by(
    stream: &mut TcpStream,
    mut buf: &mut [u8],
    deadline: Instant,
) -> Result<(), Wire> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Wire::TimedOut);
        }
        stream.set_read_timeout(Some(left)).map_err(Wire::Closed)?;
        match stream.read(buf) {
            Ok(0) => return Err(Wire::Closed(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => return Err(Wire::TimedOut),
            Err(e) => return Err(Wire::Closed(e)),
        }
    }
    Ok(())
}

/// Reads one frame, refusing a length above `max_body` before allocating anything for it, and
/// growing the buffer only as bytes actually arrive.
fn read_frame(
    stream: &mut TcpStream,
    deadline: Instant,
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

struct Client {
    stream: TcpStream,
    next_round: u64,
    /// Set once the stream may be out of step with the store (an I/O error mid-frame); every later
    /// call reports it instead of reading garbage.
    broken: Option<String>,
}

impl Client {
    fn lost(
        &mut self,
        addr: &str,
        op: &'static str,
        detail: String,
        fatal: Option<&Mutex<Option<String>>>,
    ) -> BootstrapError {
        let detail = match fatal.and_then(|f| f.lock().clone()) {
            Some(msg) => format!("{detail} (the store thread in this process failed: {msg})"),
            None => detail,
        };
        self.broken = Some(detail.clone());
        BootstrapError::StoreLost { addr: addr.to_string(), op, detail }
    }

    fn hello(
        &mut self,
        opts: &TcpStoreOptions,
        addr: &str,
        deadline: Instant,
        fatal: Option<&Mutex<Option<String>>>,
    ) -> Result<(), BootstrapError> {
        let msg = frame(
            K_HELLO,
            &[
                &MAGIC,
                &PROTOCOL_VERSION.to_le_bytes(),
                &(opts.rank as u64).to_le_bytes(),
                &(opts.world_size as u64).to_le_bytes(),
                &str_field(&opts.job_id),
            ],
        );
        let not_ours =
            "it is probably not a fabric-ep store (under torchrun the agent's own store \
                        listens on MASTER_PORT; fabric-ep uses MASTER_PORT + 1 unless FEP_MASTER_PORT names a free port)";
        match write_all_by(&mut self.stream, &msg, deadline) {
            Ok(()) => {}
            Err(Wire::TimedOut) => {
                return Err(self.lost(addr, "connect", "sending the hello timed out".into(), fatal))
            }
            Err(Wire::Closed(e)) => {
                return Err(self.lost(addr, "connect", format!("sending the hello: {e}"), fatal))
            }
            Err(Wire::Bad(m)) => return Err(BootstrapError::Protocol(m)),
        }
        let (kind, payload) = match read_frame(&mut self.stream, deadline, REPLY_MAX_FRAME) {
            Ok(f) => f,
            Err(Wire::TimedOut) => {
                let detail = format!("no answer to the hello within the timeout; {not_ours}");
                return Err(self.lost(addr, "connect", detail, fatal));
            }
            Err(Wire::Closed(e)) => {
                let detail = format!("connection closed during the hello ({e}); {not_ours}");
                return Err(self.lost(addr, "connect", detail, fatal));
            }
            Err(Wire::Bad(m)) => {
                return Err(BootstrapError::Protocol(format!(
                    "answer to the hello from {addr}: {m}; {not_ours}"
                )))
            }
        };
        let bad =
            |m: String| BootstrapError::Protocol(format!("answer to the hello from {addr}: {m}"));
        let mut f = Fields::new(&payload, "hello answer");
        match kind {
            K_WELCOME => {
                let v = f.u32().map_err(bad)?;
                if v != PROTOCOL_VERSION {
                    return Err(bad(format!(
                        "welcome for protocol v{v}, this rank speaks v{PROTOCOL_VERSION}"
                    )));
                }
                Ok(())
            }
            K_REFUSE => Err(refusal(opts, addr, &mut f).unwrap_or_else(bad)),
            other => Err(bad(format!("unexpected frame kind {other}; {not_ours}"))),
        }
    }

    fn gather(
        &mut self,
        opts: &TcpStoreOptions,
        addr: &str,
        data: &[u8],
        op: &'static str,
        fatal: Option<&Mutex<Option<String>>>,
    ) -> Result<Vec<Vec<u8>>, BootstrapError> {
        if let Some(why) = &self.broken {
            return Err(BootstrapError::StoreLost {
                addr: addr.to_string(),
                op,
                detail: format!("an earlier call left the connection unusable: {why}"),
            });
        }
        let start = Instant::now();
        let deadline = later(start, opts.timeout);
        let round = self.next_round;
        self.next_round += 1;
        let timeout_ms = u64::try_from(opts.timeout.as_millis()).unwrap_or(u64::MAX);
        let msg = frame(K_CONTRIBUTE, &[&round.to_le_bytes(), &timeout_ms.to_le_bytes(), data]);
        match write_all_by(&mut self.stream, &msg, deadline) {
            Ok(()) => {}
            Err(Wire::TimedOut) => {
                let detail =
                    format!("sending round {round} did not finish within {:?}", opts.timeout);
                return Err(self.lost(addr, op, detail, fatal));
            }
            Err(Wire::Closed(e)) => {
                return Err(self.lost(addr, op, format!("sending round {round}: {e}"), fatal))
            }
            Err(Wire::Bad(m)) => return Err(BootstrapError::Protocol(m)),
        }
        let answer_by = later(deadline, ANSWER_GRACE);
        let (kind, payload) = self.read(addr, op, round, answer_by, MAX_FRAME, fatal)?;
        let bad = |m: String| {
            BootstrapError::Protocol(format!("{op} round {round} answer from {addr}: {m}"))
        };
        let mut f = Fields::new(&payload, "gathered");
        match kind {
            K_GATHERED => {
                let (r, world) = (f.u64().map_err(bad)?, f.usize().map_err(bad)?);
                if r != round || world != opts.world_size {
                    self.broken = Some(format!("store answered round {r} of world {world}"));
                    return Err(bad(format!(
                        "store answered round {r} with {world} ranks; expected round {round} with {}",
                        opts.world_size
                    )));
                }
                // A fresh bound for the transfer itself: the round already completed.
                let transfer_by = later(Instant::now(), opts.timeout);
                let mut blobs = Vec::with_capacity(world);
                for _ in 0..world {
                    let (kind, blob) = self.read(addr, op, round, transfer_by, MAX_FRAME, fatal)?;
                    if kind != K_BLOB {
                        self.broken = Some(format!("frame kind {kind} inside a result"));
                        return Err(bad(format!("expected a blob frame, got kind {kind}")));
                    }
                    blobs.push(blob);
                }
                Ok(blobs)
            }
            K_FAILED => {
                Err(failure(op, start.elapsed(), opts.world_size, &mut f).unwrap_or_else(bad))
            }
            other => {
                self.broken = Some(format!("unexpected frame kind {other}"));
                Err(bad(format!("unexpected frame kind {other}")))
            }
        }
    }

    fn read(
        &mut self,
        addr: &str,
        op: &'static str,
        round: u64,
        deadline: Instant,
        max_body: usize,
        fatal: Option<&Mutex<Option<String>>>,
    ) -> Result<(u8, Vec<u8>), BootstrapError> {
        match read_frame(&mut self.stream, deadline, max_body) {
            Ok(f) => Ok(f),
            Err(Wire::TimedOut) => {
                let detail = format!("no answer for round {round} by the deadline (store hung?)");
                Err(self.lost(addr, op, detail, fatal))
            }
            Err(Wire::Closed(e)) => {
                let detail = format!("connection closed while waiting for round {round} ({e})");
                Err(self.lost(addr, op, detail, fatal))
            }
            Err(Wire::Bad(m)) => {
                self.broken = Some(m.clone());
                Err(BootstrapError::Protocol(format!("{op} round {round} from {addr}: {m}")))
            }
        }
    }
}

/// Turns a `REFUSE` payload into the error the refused rank reports.
fn refusal(
    opts: &TcpStoreOptions,
    addr: &str,
    f: &mut Fields<'_>,
) -> Result<BootstrapError, String> {
    Ok(match f.u8()? {
        REFUSE_JOB => BootstrapError::JobIdMismatch {
            ours: opts.job_id.clone(),
            theirs: f.string()?,
            addr: addr.to_string(),
        },
        REFUSE_WORLD => BootstrapError::WorldSizeMismatch {
            ours: opts.world_size,
            theirs: f.usize()?,
            rank: opts.rank,
        },
        REFUSE_RANGE => BootstrapError::BadRank {
            rank: opts.rank,
            world_size: f.usize()?,
            why: format!("the store at {addr} has no such rank"),
        },
        REFUSE_DUPLICATE => BootstrapError::BadRank {
            rank: opts.rank,
            world_size: opts.world_size,
            why: format!(
                "another process already joined the store at {addr} as this rank (duplicate RANK, \
                 or a stale process of an earlier run with the same job id)"
            ),
        },
        REFUSE_VERSION => BootstrapError::Protocol(format!(
            "the store at {addr} speaks bootstrap protocol v{}, this rank v{PROTOCOL_VERSION}: \
             all ranks must run the same fabric-ep build",
            f.u32()?
        )),
        code => return Err(format!("unknown refusal code {code}")),
    })
}

/// Turns a `FAILED` payload into this rank's error.
fn failure(
    op: &'static str,
    waited: Duration,
    world: usize,
    f: &mut Fields<'_>,
) -> Result<BootstrapError, String> {
    let round = f.u64()?;
    Ok(match f.u8()? {
        FAIL_TIMEOUT => {
            let n = f.usize()?;
            if n > world {
                return Err(format!("{n} missing ranks in a world of {world}"));
            }
            let missing = (0..n).map(|_| f.usize()).collect::<Result<Vec<_>, _>>()?;
            BootstrapError::Timeout { op, round, missing, waited }
        }
        FAIL_GONE => BootstrapError::PeerGone { rank: f.usize()?, op },
        FAIL_REFUSED => BootstrapError::PeerRefused { rank: f.usize()?, reason: f.string()? },
        FAIL_PROTOCOL => BootstrapError::Protocol(f.string()?),
        code => return Err(format!("unknown failure code {code}")),
    })
}

/// Connects to the store, retrying refused connections and failed name lookups (rank 0 or its DNS
/// record may appear late) until `deadline`.
///
/// NOTES: the name lookup itself is `getaddrinfo`, bounded by the resolver's own timeouts, not by
/// ours; it is retried, never waited on indefinitely by this code.
fn connect_until(
    host: &str,
    port: u16,
    addr: &str,
    deadline: Instant,
) -> Result<TcpStream, BootstrapError> {
    let mut backoff = Duration::from_millis(20);
    let mut last: Option<io::Error> = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(BootstrapError::Io {
                call: "connect (retried until the timeout: is rank 0 running, and are MASTER_ADDR \
                       and MASTER_PORT/FEP_MASTER_PORT the same on every rank?) to",
                addr: addr.to_string(),
                source: last.unwrap_or_else(|| io::ErrorKind::TimedOut.into()),
            });
        }
        match (host, port).to_socket_addrs() {
            Ok(candidates) => {
                for sa in candidates {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    match TcpStream::connect_timeout(&sa, left.min(Duration::from_secs(2))) {
                        Ok(s) => {
                            s.set_nodelay(true).map_err(|e| BootstrapError::Io {
                                call: "set TCP_NODELAY on the connection to",
                                addr: addr.to_string(),
                                source: e,
                            })?;
                            return Ok(s);
                        }
                        Err(e) => last = Some(e),
                    }
                }
            }
            Err(e) => last = Some(e),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// Binds rank 0's listener. A loopback `MASTER_ADDR` binds loopback only (local jobs and tests stay
/// off the network); anything else binds all interfaces, as torch's store does, because the name
/// other ranks use (a Kubernetes service, a load balancer) may not be an address of this host.
///
/// NOTES: std's `TcpListener::bind` sets `SO_REUSEADDR` on Unix, so a store restarted on the port
/// of a finished job does not wait out TIME_WAIT.
fn bind_store(host: &str, port: u16) -> Result<TcpListener, BootstrapError> {
    let first = (host, port).to_socket_addrs().ok().and_then(|mut a| a.next());
    let bind_to = match first {
        Some(sa) if sa.ip().is_loopback() => sa,
        Some(SocketAddr::V6(_)) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
        _ => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
    };
    TcpListener::bind(bind_to).map_err(|e| BootstrapError::Io {
        call: if e.kind() == io::ErrorKind::AddrInUse {
            "bind the store (rank 0 serves it on MASTER_PORT + 1, or FEP_MASTER_PORT if set; another \
             job, or torchrun's own store, holds that port) on"
        } else {
            "bind the store (rank 0) on"
        },
        addr: bind_to.to_string(),
        source: e,
    })
}

// ---------------------------------------------------------------------------------------------
// Store (rank 0)

/// Handle to the store thread: started with a handshake, stopped with a flag, a wake-up and a join
/// (bounded: a thread that does not report its exit in time is left detached, never waited on).
struct StoreServer {
    stop: Arc<AtomicBool>,
    wake: UnixStream,
    /// In a mutex only because `Receiver` is not `Sync` and the store must be.
    done: Mutex<mpsc::Receiver<()>>,
    thread: Option<JoinHandle<()>>,
    /// Why the store thread died, if it did; rank 0's client quotes it.
    fatal: Arc<Mutex<Option<String>>>,
}

/// Sends on drop, so the handle learns the thread ended even if it panicked.
struct DoneGuard(mpsc::SyncSender<()>);

impl Drop for DoneGuard {
    fn drop(&mut self) {
        let _ = self.0.try_send(());
    }
}

impl StoreServer {
    fn start(
        listener: TcpListener,
        job_id: String,
        world: usize,
        timeout: Duration,
        addr: &str,
    ) -> Result<Self, BootstrapError> {
        let io_err = |call: &'static str| {
            let addr = addr.to_string();
            move |source| BootstrapError::Io { call, addr, source }
        };
        listener.set_nonblocking(true).map_err(io_err("set non-blocking on the store listener"))?;
        let (wake, wake_rx) =
            UnixStream::pair().map_err(io_err("create the store wake-up pair for"))?;
        wake_rx
            .set_nonblocking(true)
            .map_err(io_err("set non-blocking on the store wake-up for"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let fatal = Arc::new(Mutex::new(None));
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (done_tx, done) = mpsc::sync_channel(1);
        let thread = {
            let stop = Arc::clone(&stop);
            let fatal = Arc::clone(&fatal);
            thread::Builder::new()
                .name("fep-bootstrap-store".into())
                .spawn(move || {
                    let _done = DoneGuard(done_tx);
                    let mut store = Store::new(listener, wake_rx, stop, job_id, world, timeout);
                    let _ = ready_tx.send(());
                    if let Err(msg) = store.run() {
                        *fatal.lock() = Some(msg);
                    }
                })
                .map_err(io_err("spawn the store thread for"))?
        };
        let mut server =
            StoreServer { stop, wake, done: Mutex::new(done), thread: Some(thread), fatal };
        if ready_rx.recv_timeout(Duration::from_secs(10)).is_err() {
            server.stop();
            return Err(BootstrapError::Protocol(format!(
                "the store thread for {addr} did not start within 10 s"
            )));
        }
        Ok(server)
    }

    fn stop(&mut self) {
        let Some(thread) = self.thread.take() else { return };
        self.stop.store(true, Ordering::Release);
        let _ = (&self.wake).write(&[1]);
        match self.done.get_mut().recv_timeout(DRAIN_GRACE + Duration::from_secs(3)) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = thread.join();
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {} // detached; it exits on its next wake-up
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Why the store can no longer complete rounds.
enum Failure {
    Timeout { missing: Vec<usize> },
    Gone { rank: usize },
    Refused { rank: usize, reason: String },
    Protocol(String),
}

struct Conn {
    stream: TcpStream,
    inbuf: Vec<u8>,
    /// Queued answers; shared buffers so a result goes to every rank from one copy.
    out: std::collections::VecDeque<(Arc<Vec<u8>>, usize)>,
    rank: Option<usize>,
    accepted: Instant,
    /// Refused: send what is queued, then close, and read nothing more.
    closing: bool,
    dead: bool,
}

struct Store {
    listener: TcpListener,
    wake: UnixStream,
    stop: Arc<AtomicBool>,
    job_id: String,
    world: usize,
    timeout: Duration,
    conns: Vec<Option<Conn>>,
    rank_conn: Vec<Option<usize>>,
    joined: Vec<bool>,
    round: u64,
    slots: Vec<Option<Vec<u8>>>,
    arrived: usize,
    round_deadline: Option<Instant>,
    failed: Option<Arc<Vec<u8>>>,
}

impl Store {
    fn new(
        listener: TcpListener,
        wake: UnixStream,
        stop: Arc<AtomicBool>,
        job_id: String,
        world: usize,
        timeout: Duration,
    ) -> Self {
        Store {
            listener,
            wake,
            stop,
            job_id,
            world,
            timeout,
            conns: Vec::new(),
            rank_conn: vec![None; world],
            joined: vec![false; world],
            round: 0,
            slots: vec![None; world],
            arrived: 0,
            round_deadline: None,
            failed: None,
        }
    }

    fn run(&mut self) -> Result<(), String> {
        loop {
            if self.stop.load(Ordering::Acquire) {
                self.drain();
                return Ok(());
            }
            let now = Instant::now();
            let mut next = later(now, Duration::from_secs(1));
            if let Some(d) = self.round_deadline {
                next = next.min(d);
            }
            for c in self.conns.iter().flatten() {
                if c.rank.is_none() && !c.closing {
                    next = next.min(later(c.accepted, self.timeout));
                }
            }
            let (mut fds, ids) = self.poll_set(false);
            poll(&mut fds, next.saturating_duration_since(now))?;
            if fds[0].revents != 0 {
                let mut sink = [0u8; 64];
                while matches!((&self.wake).read(&mut sink), Ok(n) if n > 0) {}
            }
            if fds[1].revents != 0 {
                self.accept_all();
            }
            for (fd, &id) in fds[2..].iter().zip(&ids) {
                if fd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                    self.on_readable(id);
                }
                if fd.revents & libc::POLLOUT != 0 {
                    self.flush(id);
                }
            }
            self.expire(Instant::now());
            self.reap();
        }
    }

    /// `[wake, listener, conns...]` and the slab index of each conn entry. While draining, only
    /// connections with output still queued are watched (a hung-up idle one would make `poll`
    /// return at once, over and over), and neither wake-up nor listener (`poll` skips fd -1).
    fn poll_set(&self, draining: bool) -> (Vec<libc::pollfd>, Vec<usize>) {
        let pfd = |fd, events| libc::pollfd { fd, events, revents: 0 };
        let (wake, listener) = match draining {
            // The stop request's wake-up byte may still be unread: watching it would spin.
            true => (-1, -1),
            false => (self.wake.as_raw_fd(), self.listener.as_raw_fd()),
        };
        let mut fds = vec![pfd(wake, libc::POLLIN), pfd(listener, libc::POLLIN)];
        let mut ids = Vec::new();
        for (i, c) in self.conns.iter().enumerate() {
            let Some(c) = c else { continue };
            if c.dead || (draining && c.out.is_empty()) {
                continue;
            }
            let mut events = if draining { 0 } else { libc::POLLIN };
            if !c.out.is_empty() {
                events |= libc::POLLOUT;
            }
            fds.push(pfd(c.stream.as_raw_fd(), events));
            ids.push(i);
        }
        (fds, ids)
    }

    /// After a stop request: keep writing queued answers (a final round's result to ranks slower
    /// than rank 0) until they are out or `DRAIN_GRACE` passes, then let the sockets close.
    fn drain(&mut self) {
        let until = later(Instant::now(), DRAIN_GRACE);
        loop {
            for id in 0..self.conns.len() {
                self.flush(id);
            }
            let pending = self.conns.iter().flatten().any(|c| !c.dead && !c.out.is_empty());
            let left = until.saturating_duration_since(Instant::now());
            if !pending || left.is_zero() {
                return;
            }
            let (mut fds, _) = self.poll_set(true);
            if poll(&mut fds, left).is_err() {
                return;
            }
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    // A socket we cannot configure is dropped; its client retries or times out.
                    if stream.set_nonblocking(true).is_err() || stream.set_nodelay(true).is_err() {
                        continue;
                    }
                    let conn = Conn {
                        stream,
                        inbuf: Vec::new(),
                        out: Default::default(),
                        rank: None,
                        accepted: Instant::now(),
                        closing: false,
                        dead: false,
                    };
                    match self.conns.iter().position(Option::is_none) {
                        Some(i) => self.conns[i] = Some(conn),
                        None => self.conns.push(Some(conn)),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // WouldBlock: all accepted. Anything else (EMFILE, ECONNABORTED): try again on the
                // next readiness; the pending client's own deadline bounds it.
                Err(_) => return,
            }
        }
    }

    fn on_readable(&mut self, id: usize) {
        let mut scratch = [0u8; 64 << 10];
        let mut frames = Vec::new();
        {
            let Some(Some(c)) = self.conns.get_mut(id) else { return };
            loop {
                match c.stream.read(&mut scratch) {
                    Ok(0) => {
                        c.dead = true;
                        break;
                    }
                    Ok(n) => {
                        if c.closing {
                            continue;
                        }
                        c.inbuf.extend_from_slice(&scratch[..n]);
                        let max = if c.rank.is_some() { MAX_FRAME } else { HELLO_MAX_FRAME };
                        match split_frames(&mut c.inbuf, max) {
                            Ok(mut f) => frames.append(&mut f),
                            Err(_) => {
                                // Garbage on the wire: drop the connection. A joined rank
                                // that does this is reported gone, by name, in reap().
                                c.dead = true;
                                break;
                            }
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        c.dead = true;
                        break;
                    }
                }
            }
        }
        for (kind, payload) in frames {
            let Some(Some(c)) = self.conns.get(id) else { return };
            if c.dead || c.closing {
                return;
            }
            match (c.rank, kind) {
                (None, K_HELLO) => self.on_hello(id, &payload),
                (Some(rank), K_CONTRIBUTE) => self.on_contribute(id, rank, &payload),
                (rank, kind) => {
                    if let Some(rank) = rank {
                        self.fail(Failure::Protocol(format!(
                            "rank {rank} sent frame kind {kind}, which the store does not accept"
                        )));
                    }
                    self.kill(id);
                    return;
                }
            }
        }
    }

    fn on_hello(&mut self, id: usize, payload: &[u8]) {
        let mut f = Fields::new(payload, "hello");
        let parsed = (|| -> Result<_, String> {
            if f.take(4)? != MAGIC {
                return Err("bad magic".into());
            }
            Ok((f.u32()?, f.usize()?, f.usize()?, f.string()?))
        })();
        let Ok((version, rank, world, job_id)) = parsed else {
            // Not our protocol: close without answering in a framing the peer does not speak.
            self.kill(id);
            return;
        };
        let refuse = |code: u8, rest: &[u8]| frame(K_REFUSE, &[&[code], rest]);
        let verdict = if version != PROTOCOL_VERSION {
            Err((refuse(REFUSE_VERSION, &PROTOCOL_VERSION.to_le_bytes()), None))
        } else if job_id != self.job_id {
            // Another job's process: refuse it, but it must not disturb this job.
            Err((refuse(REFUSE_JOB, &str_field(&self.job_id)), None))
        } else if world != self.world {
            let why = format!("it has WORLD_SIZE={world}, the store (rank 0) has {}", self.world);
            Err((refuse(REFUSE_WORLD, &(self.world as u64).to_le_bytes()), Some(why)))
        } else if rank >= self.world {
            let why = format!("RANK={rank} is out of range for WORLD_SIZE={}", self.world);
            Err((refuse(REFUSE_RANGE, &(self.world as u64).to_le_bytes()), Some(why)))
        } else if self.joined[rank] {
            let why = format!("two processes claim RANK={rank}");
            Err((refuse(REFUSE_DUPLICATE, &[]), Some(why)))
        } else {
            Ok(())
        };
        match verdict {
            Ok(()) => {
                self.rank_conn[rank] = Some(id);
                self.joined[rank] = true;
                if let Some(Some(c)) = self.conns.get_mut(id) {
                    c.rank = Some(rank);
                }
                self.send(id, Arc::new(frame(K_WELCOME, &[&PROTOCOL_VERSION.to_le_bytes()])));
            }
            Err((answer, poison)) => {
                if let Some(reason) = poison {
                    // Same job, wrong shape: the job cannot complete, so say so to every rank now
                    // rather than let them time out.
                    self.fail(Failure::Refused { rank, reason });
                }
                if let Some(Some(c)) = self.conns.get_mut(id) {
                    c.closing = true;
                }
                self.send(id, Arc::new(answer));
            }
        }
    }

    fn on_contribute(&mut self, id: usize, rank: usize, payload: &[u8]) {
        let mut f = Fields::new(payload, "contribute");
        let (round, timeout_ms) = match (f.u64(), f.u64()) {
            (Ok(r), Ok(t)) => (r, t),
            _ => {
                self.fail(Failure::Protocol(format!("rank {rank} sent a truncated contribution")));
                self.kill(id);
                return;
            }
        };
        let data = f.rest();
        if let Some(answer) = &self.failed {
            let answer = Arc::clone(answer);
            self.send(id, answer);
            return;
        }
        if round != self.round || self.slots[rank].is_some() {
            let msg = format!(
                "rank {rank} contributed to round {round} while the store collects round {}: \
                 ranks called all_gather/barrier a different number of times",
                self.round
            );
            self.slots[rank] = Some(Vec::new());
            self.fail(Failure::Protocol(msg));
            return;
        }
        self.slots[rank] = Some(data.to_vec());
        self.arrived += 1;
        let deadline = later(Instant::now(), Duration::from_millis(timeout_ms));
        self.round_deadline = Some(self.round_deadline.map_or(deadline, |d| d.min(deadline)));
        if self.arrived == self.world {
            self.complete();
        }
    }

    fn complete(&mut self) {
        let mut out = Vec::new();
        put_frame(
            &mut out,
            K_GATHERED,
            &[&self.round.to_le_bytes(), &(self.world as u64).to_le_bytes()],
        );
        for slot in &mut self.slots {
            put_frame(&mut out, K_BLOB, &[&slot.take().unwrap_or_default()]);
        }
        let out = Arc::new(out);
        for r in 0..self.world {
            if let Some(id) = self.rank_conn[r] {
                self.send(id, Arc::clone(&out));
            }
        }
        self.round += 1;
        self.arrived = 0;
        self.round_deadline = None;
    }

    /// Marks the store failed and tells every rank waiting in the current round; later
    /// contributions get the same answer.
    fn fail(&mut self, why: Failure) {
        if self.failed.is_some() {
            return;
        }
        let mut payload = self.round.to_le_bytes().to_vec();
        match why {
            Failure::Timeout { missing } => {
                payload.push(FAIL_TIMEOUT);
                payload.extend_from_slice(&(missing.len() as u64).to_le_bytes());
                for r in missing {
                    payload.extend_from_slice(&(r as u64).to_le_bytes());
                }
            }
            Failure::Gone { rank } => {
                payload.push(FAIL_GONE);
                payload.extend_from_slice(&(rank as u64).to_le_bytes());
            }
            Failure::Refused { rank, reason } => {
                payload.push(FAIL_REFUSED);
                payload.extend_from_slice(&(rank as u64).to_le_bytes());
                payload.extend_from_slice(&str_field(&reason));
            }
            Failure::Protocol(msg) => {
                payload.push(FAIL_PROTOCOL);
                payload.extend_from_slice(&str_field(&msg));
            }
        }
        let answer = Arc::new(frame(K_FAILED, &[&payload]));
        for r in 0..self.world {
            if let (Some(_), Some(id)) = (&self.slots[r], self.rank_conn[r]) {
                self.send(id, Arc::clone(&answer));
            }
        }
        self.failed = Some(answer);
        self.round_deadline = None;
    }

    fn expire(&mut self, now: Instant) {
        if self.round_deadline.is_some_and(|d| d <= now) {
            let missing = (0..self.world).filter(|&r| self.slots[r].is_none()).collect();
            self.fail(Failure::Timeout { missing });
        }
        for c in self.conns.iter_mut().flatten() {
            if c.rank.is_none() && !c.closing && later(c.accepted, self.timeout) <= now {
                c.dead = true; // never said hello
            }
        }
    }

    fn send(&mut self, id: usize, buf: Arc<Vec<u8>>) {
        if let Some(Some(c)) = self.conns.get_mut(id) {
            c.out.push_back((buf, 0));
        }
        self.flush(id);
    }

    fn flush(&mut self, id: usize) {
        let Some(Some(c)) = self.conns.get_mut(id) else { return };
        while let Some((buf, off)) = c.out.front_mut() {
            if c.dead {
                c.out.clear();
                break;
            }
            match c.stream.write(&buf[*off..]) {
                Ok(0) => c.dead = true,
                Ok(n) => {
                    *off += n;
                    if *off == buf.len() {
                        c.out.pop_front();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => c.dead = true,
            }
        }
        if c.closing && c.out.is_empty() {
            c.dead = true;
        }
    }

    fn kill(&mut self, id: usize) {
        if let Some(Some(c)) = self.conns.get_mut(id) {
            c.dead = true;
        }
    }

    /// Drops dead connections; a joined rank's dead connection fails the store naming that rank.
    fn reap(&mut self) {
        let mut gone = Vec::new();
        for (id, slot) in self.conns.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|c| c.dead) {
                if let Some(rank) = slot.take().and_then(|c| c.rank) {
                    if self.rank_conn[rank] == Some(id) {
                        self.rank_conn[rank] = None;
                        gone.push(rank);
                    }
                }
            }
        }
        for rank in gone {
            self.fail(Failure::Gone { rank });
        }
    }
}

/// `poll(2)` with a timeout in whole milliseconds, rounded up so that a deadline less than a
/// millisecond away sleeps instead of spinning.
fn poll(fds: &mut [libc::pollfd], wait: Duration) -> Result<(), String> {
    let ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid, exclusively borrowed slice of `pollfd` for the whole call and its
    // length is passed alongside; the fds belong to sockets this store owns.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(format!("poll: {e}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    const BASE: &[(&str, &str)] = &[
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
    ];

    fn with(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut v: Vec<_> = BASE.to_vec();
        for &(k, val) in extra {
            v.retain(|(kk, _)| *kk != k);
            v.push((k, val));
        }
        v
    }

    fn env_var_of(r: Result<TcpStoreOptions, BootstrapError>) -> &'static str {
        match r {
            Err(BootstrapError::Env { var, .. }) => var,
            other => panic!("expected an Env error, got {other:?}"),
        }
    }

    #[test]
    fn env_defaults() {
        let o = TcpStoreOptions::from_lookup(lookup(BASE), Duration::from_secs(1)).expect("opts");
        assert_eq!((o.rank, o.world_size, o.local_rank, o.local_world_size), (3, 8, 3, 8));
        assert_eq!(o.job_id, "none");
        assert_eq!(o.store_addr(), "10.0.0.1:29501", "MASTER_PORT + 1 beside torch's store");
    }

    #[test]
    fn env_overrides() {
        let vars = with(&[
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("TORCHELASTIC_RUN_ID", "elastic"),
            ("FEP_MASTER_PORT", "29600"),
        ]);
        let o = TcpStoreOptions::from_lookup(lookup(&vars), Duration::from_secs(1)).expect("opts");
        assert_eq!((o.local_rank, o.local_world_size, o.port), (1, 2, 29600));
        assert_eq!(o.job_id, "elastic");
        let vars = with(&[("TORCHELASTIC_RUN_ID", "elastic"), ("FEP_JOB_ID", "fep")]);
        let o = TcpStoreOptions::from_lookup(lookup(&vars), Duration::from_secs(1)).expect("opts");
        assert_eq!(o.job_id, "fep");
    }

    #[test]
    fn env_errors_name_the_variable() {
        let t = Duration::from_secs(1);
        for var in ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"] {
            let vars: Vec<_> = BASE.iter().copied().filter(|(k, _)| *k != var).collect();
            assert_eq!(env_var_of(TcpStoreOptions::from_lookup(lookup(&vars), t)), var);
        }
        let cases: &[(&str, &str, &str)] = &[
            ("RANK", "three", "RANK"),
            ("RANK", "8", "RANK"),
            ("WORLD_SIZE", "0", "WORLD_SIZE"),
            ("WORLD_SIZE", "99999999999", "WORLD_SIZE"),
            ("MASTER_PORT", "70000", "MASTER_PORT"),
            ("MASTER_PORT", "65535", "MASTER_PORT"),
            ("FEP_MASTER_PORT", "x", "FEP_MASTER_PORT"),
            ("LOCAL_RANK", "-1", "LOCAL_RANK"),
            ("LOCAL_WORLD_SIZE", "9", "LOCAL_WORLD_SIZE"),
        ];
        for &(k, v, expect) in cases {
            let vars = with(&[(k, v)]);
            assert_eq!(env_var_of(TcpStoreOptions::from_lookup(lookup(&vars), t)), expect);
        }
        let vars = with(&[("LOCAL_WORLD_SIZE", "2")]);
        assert_eq!(env_var_of(TcpStoreOptions::from_lookup(lookup(&vars), t)), "LOCAL_RANK");
    }

    #[test]
    fn ipv6_addr_is_bracketed() {
        let vars = with(&[("MASTER_ADDR", "::1")]);
        let o = TcpStoreOptions::from_lookup(lookup(&vars), Duration::from_secs(1)).expect("opts");
        assert_eq!(o.store_addr(), "[::1]:29501");
    }

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
    }

    fn opts(port: u16, rank: usize, world: usize, job: &str, timeout_ms: u64) -> TcpStoreOptions {
        TcpStoreOptions {
            addr: "127.0.0.1".into(),
            port,
            rank,
            world_size: world,
            local_rank: rank,
            local_world_size: world,
            job_id: job.into(),
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    fn free_port() -> u16 {
        super::super::launch::free_port().expect("port")
    }

    #[test]
    fn threads_over_tcp_gather_in_rank_order() {
        let port = free_port();
        let world = 3;
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                thread::spawn(move || {
                    let s = TcpStore::new(opts(port, rank, world, "unit", 5000))?;
                    let mut out = Vec::new();
                    for round in 0..3u8 {
                        out.push(s.all_gather(&vec![round; rank * 3])?);
                    }
                    s.barrier()?;
                    Ok::<_, BootstrapError>(out)
                })
            })
            .collect();
        for h in handles {
            let out = h.join().expect("thread").expect("gather");
            for (round, got) in out.iter().enumerate() {
                let want: Vec<Vec<u8>> = (0..world).map(|r| vec![round as u8; r * 3]).collect();
                assert_eq!(got, &want);
            }
        }
    }

    #[test]
    fn stray_client_is_refused_without_disturbing_the_job() {
        let port = free_port();
        let s0 = TcpStore::new(opts(port, 0, 1, "job-a", 3000)).expect("rank 0");
        // Rank 1 of a 2-rank job-b: the job id is checked first, and rank 0 of job-a is not disturbed.
        let err = TcpStore::new(opts(port, 1, 2, "job-b", 3000)).err().expect("refused");
        match &err {
            BootstrapError::JobIdMismatch { ours, theirs, .. } => {
                assert_eq!((ours.as_str(), theirs.as_str()), ("job-b", "job-a"));
            }
            other => panic!("expected JobIdMismatch, got {other}"),
        }
        // Garbage on the port must not disturb the job either.
        let mut junk = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let _ = junk.write_all(b"GET / HTTP/1.0\r\n\r\n");
        assert_eq!(s0.all_gather(b"ok").expect("still fine"), vec![b"ok".to_vec()]);
        s0.close().expect("close");
    }

    #[test]
    fn store_delivers_the_last_round_after_rank_0_leaves() {
        let port = free_port();
        let big = |r: usize| vec![r as u8 + 1; 8 << 20];
        let s0 = TcpStore::new(opts(port, 0, 2, "drain", 10_000)).expect("rank 0");
        // Rank 1 by hand, so that it can be slow to read its 16 MiB result.
        let o1 = opts(port, 1, 2, "drain", 10_000);
        let deadline = later(Instant::now(), o1.timeout);
        let stream = connect_until(&o1.addr, port, "test", deadline).expect("connect");
        let mut c1 = Client { stream, next_round: 0, broken: None };
        c1.hello(&o1, "test", deadline, None).expect("hello");
        let msg = frame(K_CONTRIBUTE, &[&0u64.to_le_bytes(), &10_000u64.to_le_bytes(), &big(1)]);
        let writer = thread::spawn(move || {
            write_all_by(&mut c1.stream, &msg, deadline).map_err(|_| "write").map(|()| c1)
        });
        assert_eq!(s0.all_gather(&big(0)).expect("rank 0 gather").len(), 2);
        let reader = thread::spawn(move || {
            let mut c1 = writer.join().expect("thread").expect("rank 1 contributed");
            thread::sleep(Duration::from_millis(300));
            let mut frames = Vec::new();
            for _ in 0..3 {
                frames.push(read_frame(&mut c1.stream, deadline, MAX_FRAME).ok().expect("frame"));
            }
            frames
        });
        drop(s0); // leaves while rank 1 has not read a byte of its result
        let frames = reader.join().expect("reader");
        assert_eq!(frames[0].0, K_GATHERED);
        for r in 0..2 {
            assert!(frames[r + 1].0 == K_BLOB && frames[r + 1].1 == big(r), "blob {r}");
        }
    }

    #[test]
    fn duplicate_rank_is_refused() {
        let port = free_port();
        let _s0 = TcpStore::new(opts(port, 0, 2, "dup", 3000)).expect("rank 0");
        let _s1 = TcpStore::new(opts(port, 1, 2, "dup", 3000)).expect("rank 1");
        match TcpStore::new(opts(port, 1, 2, "dup", 3000)) {
            Err(BootstrapError::BadRank { rank: 1, .. }) => {}
            other => panic!("expected BadRank, got {:?}", other.err()),
        }
    }
}
