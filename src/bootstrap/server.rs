//! The store server on rank 0: one thread per port per process, serving every [`TcpStore`]
//! instance that this process opens as rank 0 on that port.
//!
//! One file: the server is one `poll(2)` loop, and its connections, claims and namespaces (`Conn`,
//! `Claim`, `Space`, `Store`) are that loop's private state.
//!
//! NOTES: DeepEP-style users keep several Buffers alive at once (normal and low latency), each with
//! its own bootstrap from the same `MASTER_ADDR`/`MASTER_PORT`. A listener per instance would
//! collide on the port, so instances share one server, each in its own namespace: the k-th store a
//! process creates as rank r on a port is instance k, on every rank alike, because every rank
//! creates its stores in the same order. The server lives while any of its instances does; the
//! next instance after that starts a new one (ranks retry until it listens).
//!
//! The server is one thread with `poll(2)` over non-blocking sockets (no thread per rank, so a few
//! thousand ranks cost file descriptors, not threads).
//!
//! [`TcpStore`]: super::TcpStore

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Weak};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::auth::{random_bytes, JobSecret, Role, Transcript, NONCE_LEN};
use super::reports::{Held, HeldReports};
use super::wire::*;
use super::{later, BootstrapError};

/// How long a stopping store (or a closed instance) keeps flushing answers already queued (a final
/// round's result to ranks slower than rank 0) before it closes the sockets.
const DRAIN_GRACE: Duration = Duration::from_secs(2);
/// Bounds of the pause after `accept` fails for want of file descriptors (or anything unexpected):
/// without it the listener stays readable and the loop spins on a core.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Most connections accepted per wake-up, so a flood cannot starve the ranks' traffic.
const ACCEPT_BURST: usize = 256;
/// How long `open` retries a port still held, for the previous server of this process that is
/// finishing its drain.
const REBIND_WAIT: Duration = Duration::from_secs(3);
/// Most refusals remembered per instance for timeout messages.
const MAX_NOTES: usize = 16;

/// Limits on connections that have not proved the job secret yet.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ServerConfig {
    /// A connection that has not finished its handshake by then is dropped (a real rank answers
    /// within a round trip; one dropped by mistake reconnects).
    pub handshake: Duration,
    /// At most this many unproven connections (or twice the largest world, if more) are kept; a
    /// new one beyond that evicts the oldest.
    pub pending_min: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig { handshake: Duration::from_secs(5), pending_min: 256 }
    }
}

enum Cmd {
    Open { ns: u64, world: usize, job_id: String },
    Close { ns: u64 },
}

struct Control {
    cmds: Mutex<Vec<Cmd>>,
    stop: AtomicBool,
    /// Why the store thread died, if it did; rank 0's client quotes it.
    fatal: Mutex<Option<String>>,
}

/// Handle to one store thread. Started with a handshake, stopped (when its last instance goes)
/// with a flag, a wake-up and a bounded join: a thread that does not report its exit in time is
/// left detached, never waited on.
pub(super) struct Server {
    bound: SocketAddr,
    key: JobSecret,
    ctl: Arc<Control>,
    wake: UnixStream,
    /// In a mutex only because `Receiver` is not `Sync` and the store must be.
    done: Mutex<mpsc::Receiver<()>>,
    thread: Option<JoinHandle<()>>,
}

/// One instance (namespace) of a server, held by rank 0's [`TcpStore`](super::TcpStore).
pub(super) struct Instance {
    server: Arc<Server>,
    ns: u64,
}

impl Instance {
    /// Why the store thread died, if it did.
    pub(super) fn fatal(&self) -> Option<String> {
        self.server.ctl.fatal.lock().clone()
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.server.send(Cmd::Close { ns: self.ns });
    }
}

/// Live servers of this process, by port.
static SERVERS: Mutex<Vec<(u16, Weak<Server>)>> = Mutex::new(Vec::new());

/// Opens instance `ns` on this process's server for `bind`, starting the server if none is live.
#[allow(clippy::too_many_arguments)]
pub(super) fn open(
    bind: SocketAddr,
    key: &JobSecret,
    ns: u64,
    world: usize,
    job_id: &str,
    cfg: ServerConfig,
    deadline: Instant,
    addr: &str,
) -> Result<Instance, BootstrapError> {
    let mut reg = SERVERS.lock();
    reg.retain(|(_, w)| w.strong_count() > 0);
    let live = reg.iter().find(|(p, _)| *p == bind.port()).and_then(|(_, w)| w.upgrade());
    let server = match live {
        Some(s) => {
            if s.bound != bind {
                return Err(BootstrapError::Config(format!(
                    "this process already serves a fabric-ep store on {}, not {bind}: every store \
                     of a process on one port must bind the same address",
                    s.bound
                )));
            }
            if !s.key.same_key(key) {
                return Err(BootstrapError::Config(format!(
                    "this process already serves a fabric-ep store on {bind} for another job \
                     secret; give the other job its own FEP_MASTER_PORT"
                )));
            }
            s
        }
        None => {
            let listener = bind_retrying(bind, deadline, addr)?;
            let s = Server::start(listener, key.clone(), cfg, addr)?;
            reg.push((bind.port(), Arc::downgrade(&s)));
            s
        }
    };
    drop(reg);
    server.send(Cmd::Open { ns, world, job_id: job_id.to_string() });
    Ok(Instance { server, ns })
}

/// Binds, waiting up to `REBIND_WAIT` (and never past `deadline`) while the port is in use: the
/// previous server of this process may still be closing it.
///
/// NOTES: std's `TcpListener::bind` sets `SO_REUSEADDR` on Unix, so a store restarted on the port
/// of a finished job does not wait out TIME_WAIT.
fn bind_retrying(
    bind: SocketAddr,
    deadline: Instant,
    addr: &str,
) -> Result<TcpListener, BootstrapError> {
    let until = later(Instant::now(), REBIND_WAIT).min(deadline);
    loop {
        match TcpListener::bind(bind) {
            Ok(l) => return Ok(l),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && Instant::now() < until => {
                thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(BootstrapError::Io {
                    call: if e.kind() == io::ErrorKind::AddrInUse {
                        "bind the store (rank 0 serves it on MASTER_PORT + 1, or FEP_MASTER_PORT \
                         if set; another process, perhaps another job or torchrun's own store, \
                         holds that port) for"
                    } else {
                        "bind the store (rank 0) for"
                    },
                    addr: format!("{addr} (bound as {bind})"),
                    source: e,
                })
            }
        }
    }
}

/// Sends on drop, so the handle learns the thread ended even if it panicked.
struct DoneGuard(mpsc::SyncSender<()>);

impl Drop for DoneGuard {
    fn drop(&mut self) {
        let _ = self.0.try_send(());
    }
}

impl Server {
    fn start(
        listener: TcpListener,
        key: JobSecret,
        cfg: ServerConfig,
        addr: &str,
    ) -> Result<Arc<Self>, BootstrapError> {
        let io_err = |call: &'static str| {
            let addr = addr.to_string();
            move |source| BootstrapError::Io { call, addr, source }
        };
        let bound = listener.local_addr().map_err(io_err("read the address of the store"))?;
        listener.set_nonblocking(true).map_err(io_err("set non-blocking on the store listener"))?;
        let (wake, wake_rx) =
            UnixStream::pair().map_err(io_err("create the store wake-up pair for"))?;
        for s in [&wake, &wake_rx] {
            s.set_nonblocking(true).map_err(io_err("set non-blocking on the store wake-up for"))?;
        }
        let ctl = Arc::new(Control {
            cmds: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            fatal: Mutex::new(None),
        });
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (done_tx, done) = mpsc::sync_channel(1);
        let thread = {
            let ctl = Arc::clone(&ctl);
            let key = key.clone();
            thread::Builder::new()
                .name("fep-bootstrap-store".into())
                .spawn(move || {
                    let _done = DoneGuard(done_tx);
                    let mut store = Store::new(listener, wake_rx, Arc::clone(&ctl), key, cfg);
                    let _ = ready_tx.send(());
                    if let Err(msg) = store.run() {
                        *ctl.fatal.lock() = Some(msg);
                    }
                })
                .map_err(io_err("spawn the store thread for"))?
        };
        let server = Arc::new(Server {
            bound,
            key,
            ctl,
            wake,
            done: Mutex::new(done),
            thread: Some(thread),
        });
        if ready_rx.recv_timeout(Duration::from_secs(10)).is_err() {
            return Err(BootstrapError::Protocol(format!(
                "the store thread for {addr} did not start within 10 s"
            )));
        }
        Ok(server)
    }

    fn send(&self, cmd: Cmd) {
        self.ctl.cmds.lock().push(cmd);
        self.poke();
    }

    fn poke(&self) {
        // A full pipe already holds a wake-up; nothing else can fail on a live pair.
        let _ = (&self.wake).write(&[1]);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let Some(thread) = self.thread.take() else { return };
        self.ctl.stop.store(true, Ordering::Release);
        self.poke();
        match self.done.get_mut().recv_timeout(DRAIN_GRACE + Duration::from_secs(3)) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = thread.join();
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {} // detached; it exits on its next wake-up
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The store thread

/// Why an instance can no longer complete rounds.
enum Failure {
    Timeout { missing: Vec<usize> },
    Gone { rank: usize },
    Protocol(String),
}

/// What a connection claimed in its hello; trusted only once its proof checked out.
struct Claim {
    ns: u64,
    rank: usize,
    world: usize,
    client_nonce: [u8; NONCE_LEN],
    server_nonce: [u8; NONCE_LEN],
    job_id: String,
}

impl Claim {
    fn transcript(&self) -> Transcript<'_> {
        Transcript {
            server_nonce: &self.server_nonce,
            client_nonce: &self.client_nonce,
            instance: self.ns,
            rank: self.rank as u64,
            world: self.world as u64,
            job_id: &self.job_id,
        }
    }
}

enum Phase {
    /// Accepted; no hello yet.
    Hello,
    /// Challenge sent; the proof is due. Unproven, like `Hello`.
    Proof(Claim),
    /// Proved the secret; waits for rank 0 to open its instance.
    Waiting(Claim),
    /// A rank of instance `ns`.
    Joined { ns: u64, rank: usize },
    /// Refused, or its instance closed: flushes what is queued, then closes.
    Done,
}

struct Conn {
    stream: TcpStream,
    inbuf: Vec<u8>,
    /// Queued answers; shared buffers so a result goes to every rank from one copy.
    out: VecDeque<(Arc<Vec<u8>>, usize)>,
    phase: Phase,
    accepted: Instant,
    /// Closing (phase `Done`): give up on queued output at this time.
    close_by: Option<Instant>,
    dead: bool,
}

impl Conn {
    fn unproven(&self) -> bool {
        !self.dead && matches!(self.phase, Phase::Hello | Phase::Proof(_))
    }
}

/// One instance: its ranks and rounds.
struct Space {
    world: usize,
    job_id: String,
    rank_conn: Vec<Option<usize>>,
    joined: Vec<bool>,
    round: u64,
    slots: Vec<Option<Vec<u8>>>,
    arrived: usize,
    round_deadline: Option<Instant>,
    failed: Option<Arc<Vec<u8>>>,
    /// Ranks whose connection closed, in order; told to every rank that joins later too.
    gone: Vec<usize>,
    /// Ranks another rank reported unresponsive, each relayed once.
    unresponsive: Vec<usize>,
    /// Ranks that reported others (alive, whatever they were reported as).
    reporters: Vec<usize>,
    /// Reports held for their grace.
    held: HeldReports,
    /// Refused claims of a rank, for the timeout message that names it missing.
    notes: Vec<(usize, String)>,
}

type Conns = Vec<Option<Conn>>;

struct Store {
    listener: Option<TcpListener>,
    wake: UnixStream,
    ctl: Arc<Control>,
    key: JobSecret,
    cfg: ServerConfig,
    conns: Conns,
    spaces: HashMap<u64, Space>,
    closed: HashSet<u64>,
    accept_paused_until: Option<Instant>,
    accept_backoff: Duration,
}

impl Store {
    fn new(
        listener: TcpListener,
        wake: UnixStream,
        ctl: Arc<Control>,
        key: JobSecret,
        cfg: ServerConfig,
    ) -> Self {
        Store {
            listener: Some(listener),
            wake,
            ctl,
            key,
            cfg,
            conns: Vec::new(),
            spaces: HashMap::new(),
            closed: HashSet::new(),
            accept_paused_until: None,
            accept_backoff: ACCEPT_BACKOFF_MIN,
        }
    }

    fn run(&mut self) -> Result<(), String> {
        loop {
            self.apply_cmds();
            if self.ctl.stop.load(Ordering::Acquire) {
                // Close the port first: the next server of this process may bind it while this
                // one drains, and ranks knocking meanwhile are refused and retry.
                self.listener = None;
                self.drain();
                return Ok(());
            }
            let now = Instant::now();
            let mut next = later(now, Duration::from_secs(1));
            for s in self.spaces.values() {
                if let Some(d) = s.round_deadline {
                    next = next.min(d);
                }
                if let Some(at) = s.held.next_due() {
                    next = next.min(at);
                }
            }
            for c in self.conns.iter().flatten() {
                if c.unproven() {
                    next = next.min(later(c.accepted, self.cfg.handshake));
                }
                if let Some(d) = c.close_by {
                    next = next.min(d);
                }
            }
            if let Some(d) = self.accept_paused_until {
                next = next.min(d);
            }
            let (mut fds, ids) = self.poll_set(false);
            poll(&mut fds, next.saturating_duration_since(now))?;
            if fds[0].revents != 0 {
                let mut sink = [0u8; 64];
                while matches!((&self.wake).read(&mut sink), Ok(n) if n > 0) {}
            }
            if fds[1].revents != 0 || self.accept_paused_until.is_some_and(|d| d <= Instant::now())
            {
                self.accept_all();
            }
            for (fd, &id) in fds[2..].iter().zip(&ids) {
                if fd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                    self.on_readable(id);
                }
                if fd.revents & libc::POLLOUT != 0 {
                    flush(&mut self.conns, id);
                }
            }
            self.expire(Instant::now());
            self.reap();
        }
    }

    fn apply_cmds(&mut self) {
        let cmds = std::mem::take(&mut *self.ctl.cmds.lock());
        for cmd in cmds {
            match cmd {
                Cmd::Open { ns, world, job_id } => {
                    self.spaces.insert(ns, Space::new(world, job_id));
                    let waiting: Vec<usize> = (0..self.conns.len())
                        .filter(|&id| {
                            matches!(&self.conns[id], Some(Conn { phase: Phase::Waiting(c), .. })
                                if c.ns == ns)
                        })
                        .collect();
                    for id in waiting {
                        self.try_join(id);
                    }
                }
                Cmd::Close { ns } => {
                    self.spaces.remove(&ns);
                    self.closed.insert(ns);
                    let close_by = later(Instant::now(), DRAIN_GRACE);
                    for id in 0..self.conns.len() {
                        let Some(c) = self.conns[id].as_mut() else { continue };
                        match &c.phase {
                            Phase::Joined { ns: n, .. } if *n == ns => {
                                c.phase = Phase::Done;
                                c.close_by = Some(close_by);
                                flush(&mut self.conns, id);
                            }
                            Phase::Waiting(claim) if claim.ns == ns => self.try_join(id),
                            _ => {}
                        }
                    }
                }
            }
        }
    }

    /// `[wake, listener, conns...]` and the slab index of each conn entry. While draining, only
    /// connections with output still queued are watched (a hung-up idle one would make `poll`
    /// return at once, over and over), and neither wake-up nor listener (`poll` skips fd -1).
    fn poll_set(&self, draining: bool) -> (Vec<libc::pollfd>, Vec<usize>) {
        let pfd = |fd, events| libc::pollfd { fd, events, revents: 0 };
        // The stop request's wake-up byte may still be unread while draining: watching it would
        // spin. A paused listener is left out for the same reason.
        let wake = if draining { -1 } else { self.wake.as_raw_fd() };
        let listener = match (&self.listener, self.accept_paused_until) {
            (Some(l), None) if !draining => l.as_raw_fd(),
            _ => -1,
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
                flush(&mut self.conns, id);
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

    fn pending_cap(&self) -> usize {
        let largest = self.spaces.values().map(|s| s.world).max().unwrap_or(0);
        self.cfg.pending_min.max(largest.saturating_mul(2))
    }

    /// Closes the oldest connection that has not proved the secret; false if there is none.
    fn evict_oldest_unproven(&mut self) -> bool {
        let oldest = (0..self.conns.len())
            .filter(|&i| self.conns[i].as_ref().is_some_and(Conn::unproven))
            .min_by_key(|&i| self.conns[i].as_ref().map(|c| c.accepted));
        match oldest {
            Some(i) => {
                // Dropped now, not at the next reap: the caller may need its descriptor.
                self.conns[i] = None;
                true
            }
            None => false,
        }
    }

    fn pause_accept(&mut self) {
        self.accept_paused_until = Some(later(Instant::now(), self.accept_backoff));
        self.accept_backoff = (self.accept_backoff * 2).min(ACCEPT_BACKOFF_MAX);
    }

    fn accept_all(&mut self) {
        self.accept_paused_until = None;
        for _ in 0..ACCEPT_BURST {
            let Some(listener) = &self.listener else { return };
            match listener.accept() {
                Ok((stream, _)) => {
                    self.accept_backoff = ACCEPT_BACKOFF_MIN;
                    // A socket we cannot configure is dropped; its client retries or times out.
                    if stream.set_nonblocking(true).is_err() || stream.set_nodelay(true).is_err() {
                        continue;
                    }
                    keepalive(&stream);
                    let unproven = self.conns.iter().flatten().filter(|c| c.unproven()).count();
                    if unproven >= self.pending_cap() {
                        self.evict_oldest_unproven();
                    }
                    let conn = Conn {
                        stream,
                        inbuf: Vec::new(),
                        out: VecDeque::new(),
                        phase: Phase::Hello,
                        accepted: Instant::now(),
                        close_by: None,
                        dead: false,
                    };
                    match self.conns.iter().position(Option::is_none) {
                        Some(i) => self.conns[i] = Some(conn),
                        None => self.conns.push(Some(conn)),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => match e.raw_os_error() {
                    // Out of descriptors: free one held by a stranger (or a rank slow to prove
                    // itself, which reconnects) and take the waiting connection; with none to
                    // free, back off rather than spin on a listener that stays readable.
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                        if !self.evict_oldest_unproven() {
                            self.pause_accept();
                            return;
                        }
                    }
                    // The connection died in the queue (accept(2) reports its network errors).
                    Some(
                        libc::ECONNABORTED
                        | libc::EPROTO
                        | libc::ENETDOWN
                        | libc::ENOPROTOOPT
                        | libc::EHOSTDOWN
                        | libc::ENONET
                        | libc::EHOSTUNREACH
                        | libc::EOPNOTSUPP
                        | libc::ENETUNREACH
                        | libc::EPERM,
                    ) => {}
                    _ => {
                        self.pause_accept();
                        return;
                    }
                },
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
                        if matches!(c.phase, Phase::Done) {
                            continue;
                        }
                        c.inbuf.extend_from_slice(&scratch[..n]);
                        let max = match c.phase {
                            Phase::Joined { .. } => MAX_FRAME,
                            _ => HELLO_MAX_FRAME,
                        };
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
            if c.dead {
                return;
            }
            match (&c.phase, kind) {
                (Phase::Hello, K_HELLO) => self.on_hello(id, &payload),
                (Phase::Proof(_), K_PROOF) => self.on_proof(id, &payload),
                (&Phase::Joined { ns, rank }, K_CONTRIBUTE) => {
                    self.on_contribute(id, ns, rank, &payload)
                }
                (&Phase::Joined { ns, rank }, K_UNRESPONSIVE) => {
                    let Some(space) = self.spaces.get_mut(&ns) else { continue };
                    match parse_unresponsive(&payload, space.world) {
                        Ok(peers) => space.on_unresponsive(rank, &peers),
                        Err(m) => {
                            let msg = format!("rank {rank}: {m}");
                            space.fail(&mut self.conns, Failure::Protocol(msg));
                            self.kill(id);
                            return;
                        }
                    }
                }
                (Phase::Done, _) => return,
                (&Phase::Joined { ns, rank }, kind) => {
                    if let Some(space) = self.spaces.get_mut(&ns) {
                        let msg = format!(
                            "rank {rank} sent frame kind {kind}, which the store does not accept"
                        );
                        space.fail(&mut self.conns, Failure::Protocol(msg));
                    }
                    self.kill(id);
                    return;
                }
                // Anything out of order before joining: not a rank of ours.
                _ => {
                    self.kill(id);
                    return;
                }
            }
        }
    }

    fn on_hello(&mut self, id: usize, payload: &[u8]) {
        let (rank, world, ns, client_nonce) = match parse_hello(payload) {
            Ok(h) => (h.rank, h.world, h.instance, h.client_nonce),
            Err(HelloError::Version(_)) => {
                let answer = frame(K_REFUSE, &[&[REFUSE_VERSION], &PROTOCOL_VERSION.to_le_bytes()]);
                self.finish(id, answer);
                return;
            }
            Err(HelloError::NotOurs) => {
                // Not our protocol: close without answering in a framing the peer does not speak.
                self.kill(id);
                return;
            }
        };
        let Ok(server_nonce) = random_bytes::<NONCE_LEN>() else {
            // Without fresh randomness the challenge would be replayable: refuse to run it.
            self.kill(id);
            return;
        };
        let challenge = frame(K_CHALLENGE, &[&PROTOCOL_VERSION.to_le_bytes(), &server_nonce]);
        if let Some(Some(c)) = self.conns.get_mut(id) {
            c.phase = Phase::Proof(Claim {
                ns,
                rank,
                world,
                client_nonce,
                server_nonce,
                job_id: String::new(),
            });
        }
        send(&mut self.conns, id, Arc::new(challenge));
    }

    fn on_proof(&mut self, id: usize, payload: &[u8]) {
        let Some(Some(c)) = self.conns.get_mut(id) else { return };
        let Phase::Proof(mut claim) = std::mem::replace(&mut c.phase, Phase::Done) else { return };
        let Ok((tag, job_id)) = parse_proof(payload) else {
            self.kill(id);
            return;
        };
        claim.job_id = job_id;
        if claim.job_id.len() > MAX_JOB_ID || !self.key.check(Role::Rank, &claim.transcript(), &tag)
        {
            // Nothing about the job is said to a connection that does not know its secret.
            self.finish(id, frame(K_REFUSE, &[&[REFUSE_AUTH]]));
            return;
        }
        c.phase = Phase::Waiting(claim);
        self.try_join(id);
    }

    /// A proven connection joins its instance if rank 0 opened it; otherwise it keeps waiting
    /// (bounded by the rank's own deadline).
    fn try_join(&mut self, id: usize) {
        let Some(Some(c)) = self.conns.get_mut(id) else { return };
        let ns = match &c.phase {
            Phase::Waiting(claim) => claim.ns,
            _ => return,
        };
        if self.closed.contains(&ns) {
            let answer = frame(K_REFUSE, &[&[REFUSE_CLOSED]]);
            self.finish(id, answer);
            return;
        }
        let Some(space) = self.spaces.get_mut(&ns) else { return };
        let Phase::Waiting(claim) = std::mem::replace(&mut c.phase, Phase::Done) else { return };
        let (rank, world) = (claim.rank, claim.world);
        let refuse = |code: u8, rest: &[u8]| frame(K_REFUSE, &[&[code], rest]);
        let verdict = if claim.job_id != space.job_id {
            // Proved the secret, so it may learn the id: two jobs were given one secret.
            Err((refuse(REFUSE_JOB, &str_field(&space.job_id)), None))
        } else if world != space.world {
            let why = format!(
                "a process claiming rank {rank} has WORLD_SIZE={world}, the store (rank 0) has {}",
                space.world
            );
            Err((refuse(REFUSE_WORLD, &(space.world as u64).to_le_bytes()), Some(why)))
        } else if rank >= space.world {
            let why = format!("a process claimed RANK={rank}, out of range for WORLD_SIZE={world}");
            Err((refuse(REFUSE_RANGE, &(space.world as u64).to_le_bytes()), Some(why)))
        } else if space.joined[rank] {
            let why = format!("a second process claimed RANK={rank} and was refused");
            Err((refuse(REFUSE_DUPLICATE, &[]), Some(why)))
        } else {
            Ok(())
        };
        match verdict {
            Ok(()) => {
                space.rank_conn[rank] = Some(id);
                space.joined[rank] = true;
                c.phase = Phase::Joined { ns, rank };
                let proof = self.key.prove(Role::Store, &claim.transcript());
                send(&mut self.conns, id, Arc::new(frame(K_WELCOME, &[&proof])));
                // A rank that joins after a death learns it at once, like the others did.
                for &g in &space.gone {
                    send(&mut self.conns, id, Arc::new(gone_frame(g)));
                }
            }
            Err((answer, note)) => {
                // Refused alone: the job goes on, and the real rank can still join.
                if let Some(note) = note {
                    if space.notes.len() < MAX_NOTES {
                        space.notes.push((rank, note));
                    }
                }
                self.finish(id, answer);
            }
        }
    }

    /// Sends `answer`, then closes the connection (bounded by `DRAIN_GRACE`).
    fn finish(&mut self, id: usize, answer: Vec<u8>) {
        if let Some(Some(c)) = self.conns.get_mut(id) {
            c.phase = Phase::Done;
            c.close_by = Some(later(Instant::now(), DRAIN_GRACE));
        }
        send(&mut self.conns, id, Arc::new(answer));
    }

    fn on_contribute(&mut self, id: usize, ns: u64, rank: usize, payload: &[u8]) {
        let Some(space) = self.spaces.get_mut(&ns) else { return };
        if !space.contribute(&mut self.conns, id, rank, payload) {
            self.kill(id);
        }
    }

    fn expire(&mut self, now: Instant) {
        for space in self.spaces.values_mut() {
            space.relay_held(&mut self.conns, Some(now));
            if space.round_deadline.is_some_and(|d| d <= now) {
                let missing = (0..space.world).filter(|&r| space.slots[r].is_none()).collect();
                space.fail(&mut self.conns, Failure::Timeout { missing });
            }
        }
        let handshake = self.cfg.handshake;
        for c in self.conns.iter_mut().flatten() {
            if (c.unproven() && later(c.accepted, handshake) <= now)
                || c.close_by.is_some_and(|d| d <= now)
            {
                c.dead = true;
            }
        }
    }

    fn kill(&mut self, id: usize) {
        if let Some(Some(c)) = self.conns.get_mut(id) {
            c.dead = true;
        }
    }

    /// Drops dead connections; a joined rank's dead connection fails its instance naming that
    /// rank, and every rank of the instance is told at once.
    fn reap(&mut self) {
        let mut gone = Vec::new();
        for (id, slot) in self.conns.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|c| c.dead) {
                if let Some(Conn { phase: Phase::Joined { ns, rank }, .. }) = slot.take() {
                    gone.push((id, ns, rank));
                }
            }
        }
        for (id, ns, rank) in gone {
            if let Some(space) = self.spaces.get_mut(&ns) {
                if space.rank_conn[rank] == Some(id) {
                    space.rank_conn[rank] = None;
                    space.on_gone(&mut self.conns, rank);
                }
            }
        }
    }
}

fn gone_frame(rank: usize) -> Vec<u8> {
    frame(K_PEER_GONE, &[&(rank as u64).to_le_bytes()])
}

fn send(conns: &mut Conns, id: usize, buf: Arc<Vec<u8>>) {
    if let Some(Some(c)) = conns.get_mut(id) {
        c.out.push_back((buf, 0));
    }
    flush(conns, id);
}

fn flush(conns: &mut Conns, id: usize) {
    let Some(Some(c)) = conns.get_mut(id) else { return };
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
    if matches!(c.phase, Phase::Done) && c.out.is_empty() {
        c.dead = true;
    }
}

impl Space {
    fn new(world: usize, job_id: String) -> Self {
        Space {
            world,
            job_id,
            rank_conn: vec![None; world],
            joined: vec![false; world],
            round: 0,
            slots: vec![None; world],
            arrived: 0,
            round_deadline: None,
            failed: None,
            gone: Vec::new(),
            unresponsive: Vec::new(),
            reporters: Vec::new(),
            held: HeldReports::default(),
            notes: Vec::new(),
        }
    }

    /// Takes `rank`'s contribution; false if the connection must be dropped.
    fn contribute(&mut self, conns: &mut Conns, id: usize, rank: usize, payload: &[u8]) -> bool {
        let (round, timeout_ms, data) = match parse_contribute(payload) {
            Ok(v) => v,
            Err(_) => {
                self.fail(
                    conns,
                    Failure::Protocol(format!("rank {rank} sent a truncated contribution")),
                );
                return false;
            }
        };
        if let Some(answer) = &self.failed {
            send(conns, id, Arc::clone(answer));
            return true;
        }
        if round != self.round || self.slots[rank].is_some() {
            let msg = format!(
                "rank {rank} contributed to round {round} while the store collects round {}: \
                 ranks called all_gather/barrier a different number of times",
                self.round
            );
            self.slots[rank] = Some(Vec::new());
            self.fail(conns, Failure::Protocol(msg));
            return true;
        }
        self.slots[rank] = Some(data.to_vec());
        self.arrived += 1;
        // The round's bound: the earliest of the ranks' own.
        let deadline = later(Instant::now(), Duration::from_millis(timeout_ms));
        self.round_deadline = Some(self.round_deadline.map_or(deadline, |d| d.min(deadline)));
        if self.arrived == self.world {
            self.complete(conns);
        }
        true
    }

    fn complete(&mut self, conns: &mut Conns) {
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
                send(conns, id, Arc::clone(&out));
            }
        }
        self.round += 1;
        self.arrived = 0;
        self.round_deadline = None;
    }

    /// A joined rank's connection closed: every rank hears it now, and the instance fails.
    /// Rank `by` timed out on `peers` and is about to fail: held for [`REPORT_GRACE`] (see
    /// [`Self::relay_held`]). `by` itself is alive: no report names it from now on.
    fn on_unresponsive(&mut self, by: usize, peers: &[usize]) {
        if !self.reporters.contains(&by) {
            self.reporters.push(by);
        }
        self.held.push(by, peers.to_vec(), Instant::now(), REPORT_GRACE);
    }

    /// Relays the reports whose grace ended by `now` (all of them with `now` = None), upstream
    /// first (see [`HeldReports`]): every rank hears once of each named rank not gone, not
    /// already relayed and not a reporter itself; then the reporter gets its `REPORTED`. The
    /// instance stays up.
    fn relay_held(&mut self, conns: &mut Conns, now: Option<Instant>) {
        for Held { by, peers, .. } in self.held.take_due(now) {
            for p in peers {
                if p == by
                    || self.gone.contains(&p)
                    || self.unresponsive.contains(&p)
                    || self.reporters.contains(&p)
                {
                    continue;
                }
                self.unresponsive.push(p);
                let note = Arc::new(frame(
                    K_PEER_UNRESPONSIVE,
                    &[&(p as u64).to_le_bytes(), &(by as u64).to_le_bytes()],
                ));
                for id in self.rank_conn.iter().flatten() {
                    send(conns, *id, Arc::clone(&note));
                }
            }
            if let Some(id) = self.rank_conn[by] {
                send(conns, id, Arc::new(frame(K_REPORTED, &[])));
            }
        }
    }

    fn on_gone(&mut self, conns: &mut Conns, rank: usize) {
        if self.gone.contains(&rank) {
            return;
        }
        // A reporter that leaves before its grace ended: what it reported goes out first.
        if self.held.holds_from(rank) {
            self.relay_held(conns, None);
        }
        self.gone.push(rank);
        let note = Arc::new(gone_frame(rank));
        for id in self.rank_conn.iter().flatten() {
            send(conns, *id, Arc::clone(&note));
        }
        self.fail(conns, Failure::Gone { rank });
    }

    /// Marks the instance failed and tells every rank waiting in the current round; later
    /// contributions get the same answer.
    fn fail(&mut self, conns: &mut Conns, why: Failure) {
        if self.failed.is_some() {
            return;
        }
        let mut payload = self.round.to_le_bytes().to_vec();
        match why {
            Failure::Timeout { missing } => {
                payload.push(FAIL_TIMEOUT);
                payload.extend_from_slice(&(missing.len() as u64).to_le_bytes());
                for r in &missing {
                    payload.extend_from_slice(&(*r as u64).to_le_bytes());
                }
                let notes: Vec<&str> = self
                    .notes
                    .iter()
                    .filter(|(r, _)| missing.contains(r))
                    .map(|(_, n)| n.as_str())
                    .collect();
                let note = if notes.is_empty() {
                    String::new()
                } else {
                    format!("; the store refused: {}", notes.join("; "))
                };
                payload.extend_from_slice(&str_field(&note));
            }
            Failure::Gone { rank } => {
                payload.push(FAIL_GONE);
                payload.extend_from_slice(&(rank as u64).to_le_bytes());
            }
            Failure::Protocol(msg) => {
                payload.push(FAIL_PROTOCOL);
                payload.extend_from_slice(&str_field(&msg));
            }
        }
        let answer = Arc::new(frame(K_FAILED, &[&payload]));
        for r in 0..self.world {
            if let (Some(_), Some(id)) = (&self.slots[r], self.rank_conn[r]) {
                send(conns, id, Arc::clone(&answer));
            }
        }
        self.failed = Some(answer);
        self.round_deadline = None;
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
