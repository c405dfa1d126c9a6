//! A liveness channel for a bootstrap that cannot watch its peers by itself (a caller's
//! all-gather: the C ABI's callback, a torch process group).
//!
//! Rank 0 listens on an ephemeral TCP port; its addresses and a random token (the [`Beacon`])
//! travel in the bootstrap's first all-gather, so nothing has to be configured. Every other rank
//! keeps one connection to it, opened in the background, and proves the token. Rank 0 relays
//! "rank r left" to every connected rank when r's connection closes (killed, crashed, or it
//! closed its bootstrap) or TCP keepalive gives up on its host; when rank 0 itself dies, every
//! connection closes and the others name rank 0. What they learn goes into the bootstrap's
//! [`DeadSet`], the same list the TCP store feeds, which every data-path wait asks. A rank that
//! is failing because a peer stopped responding (a stopped process keeps its connection open)
//! sends `REPORT { peer }` on its connection (rank 0: to its own relay). Rank 0 holds each
//! report for a grace (a named rank that reports too meanwhile is alive, and is dropped), then
//! relays `STALLED { peer | by << 32 }` to every rank once per peer and answers the reporter
//! `REPORTED`, which it waits for before failing: the others name the stalled rank, not the
//! reporter, when it leaves.
//!
//! NOTES: bounded and fallible. Connecting, the handshake and every write have deadlines; a rank
//! that cannot reach rank 0 (an address it cannot route to, a firewall) logs a warning and goes
//! on without the channel (its waits still end at their own timeouts). Connections that do not
//! prove the token within [`HELLO_WAIT`] are dropped, and at most [`MAX_PENDING`] wait at once.
//! A joiner counts a closed connection as rank 0's death only after rank 0 welcomed it, so an
//! address that reaches some other listener is just skipped.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::auth::random_bytes;
use super::reports::{Held, HeldReports};
use super::wire::keepalive;
use super::DeadSet;

/// Bytes of the beacon slot in the first all-gather (every rank sends this many; only rank 0's
/// holds a beacon).
pub(crate) const BEACON_BYTES: usize = 256;

const MAGIC: &[u8; 4] = b"FEPL";
const VERSION: u8 = 1;
const MAX_ADDRS: usize = 8;
/// magic, version, address count, port, token.
const BEACON_HEAD: usize = 4 + 1 + 1 + 2 + 16;
/// family (4 or 6) and 16 address bytes.
const ADDR_BYTES: usize = 17;
/// magic, version, token, rank, world.
const HELLO_BYTES: usize = 4 + 1 + 16 + 8 + 8;

/// Rank 0 -> a joiner: the hello was accepted.
const K_WELCOME: u8 = 1;
/// Rank 0 -> every joiner: `rank u64` left the job.
const K_LEFT: u8 = 2;
/// A joiner -> rank 0: `peer u64` stopped responding (this rank is failing because of it).
const K_REPORT: u8 = 3;
/// Rank 0 -> every joiner: `peer | by << 32` (u64): rank `by` reported `peer` unresponsive.
const K_STALLED: u8 = 4;
/// Rank 0 -> a joiner: one of its reports was dealt with (relayed, or dropped as alive).
const K_REPORTED: u8 = 5;
/// How long rank 0 holds a report for the named ranks to show they are alive.
const REPORT_GRACE: Duration = Duration::from_millis(300);
/// Input a proven connection may hold unparsed (a rank reports at most every other rank).
const MAX_INPUT: usize = 64 << 10;
const FRAME_BYTES: usize = 9;

/// How long a new connection may take to prove the token.
const HELLO_WAIT: Duration = Duration::from_secs(5);
/// Unproven connections rank 0 holds at once; more are closed at accept.
const MAX_PENDING: usize = 64;
/// Each address a joiner tries.
const CONNECT_WAIT: Duration = Duration::from_secs(2);
/// How often the threads look at their stop flag.
const TICK: Duration = Duration::from_millis(100);
/// How often a joiner looks for reports to send.
const REPORT_TICK: Duration = Duration::from_millis(5);

/// Where rank 0 listens and the token a joiner proves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Beacon {
    pub addrs: Vec<IpAddr>,
    pub port: u16,
    pub token: [u8; 16],
}

impl Beacon {
    pub fn encode(&self) -> [u8; BEACON_BYTES] {
        let mut out = [0u8; BEACON_BYTES];
        out[..4].copy_from_slice(MAGIC);
        out[4] = VERSION;
        let addrs = &self.addrs[..self.addrs.len().min(MAX_ADDRS)];
        out[5] = addrs.len() as u8;
        out[6..8].copy_from_slice(&self.port.to_le_bytes());
        out[8..24].copy_from_slice(&self.token);
        for (i, a) in addrs.iter().enumerate() {
            let at = BEACON_HEAD + i * ADDR_BYTES;
            match a {
                IpAddr::V4(v4) => {
                    out[at] = 4;
                    out[at + 1..at + 5].copy_from_slice(&v4.octets());
                }
                IpAddr::V6(v6) => {
                    out[at] = 6;
                    out[at + 1..at + 17].copy_from_slice(&v6.octets());
                }
            }
        }
        out
    }

    /// `None` for a slot that holds no beacon (all zeros: rank 0 could not listen), or one this
    /// version cannot read.
    pub fn decode(b: &[u8]) -> Option<Beacon> {
        if b.len() < BEACON_HEAD || &b[..4] != MAGIC || b[4] != VERSION {
            return None;
        }
        let n = usize::from(b[5]);
        if n == 0 || n > MAX_ADDRS || b.len() < BEACON_HEAD + n * ADDR_BYTES {
            return None;
        }
        let port = u16::from_le_bytes([b[6], b[7]]);
        let mut token = [0u8; 16];
        token.copy_from_slice(&b[8..24]);
        let mut addrs = Vec::with_capacity(n);
        for i in 0..n {
            let at = BEACON_HEAD + i * ADDR_BYTES;
            let raw = &b[at + 1..at + 17];
            addrs.push(match b[at] {
                4 => IpAddr::V4(Ipv4Addr::new(raw[0], raw[1], raw[2], raw[3])),
                6 => {
                    let mut o = [0u8; 16];
                    o.copy_from_slice(raw);
                    IpAddr::V6(Ipv6Addr::from(o))
                }
                _ => return None,
            });
        }
        Some(Beacon { addrs, port, token })
    }
}

/// This host's addresses a peer may reach rank 0 at: IPv4 and global IPv6 interface addresses
/// (link-local ones need a scope a peer cannot know), loopback last (same-host ranks).
fn host_addrs(v6: bool) -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates a list we walk read-only and free with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } == 0 {
        let mut cur = list;
        while !cur.is_null() {
            // SAFETY: `cur` is a node of the list getifaddrs returned; ifa_addr may be NULL.
            let ifa = unsafe { &*cur };
            cur = ifa.ifa_next;
            if ifa.ifa_addr.is_null() || ifa.ifa_flags & libc::IFF_UP as u32 == 0 {
                continue;
            }
            // SAFETY: the family says which sockaddr type ifa_addr points at.
            let ip = unsafe {
                match i32::from((*ifa.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                        IpAddr::V4(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)))
                    }
                    libc::AF_INET6 if v6 => {
                        let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                        IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr))
                    }
                    _ => continue,
                }
            };
            let link_local = matches!(ip, IpAddr::V6(v) if v.segments()[0] & 0xffc0 == 0xfe80);
            if !ip.is_loopback() && !ip.is_unspecified() && !link_local && !out.contains(&ip) {
                out.push(ip);
            }
        }
        // SAFETY: `list` came from getifaddrs and is freed once.
        unsafe { libc::freeifaddrs(list) };
    }
    out.truncate(MAX_ADDRS - 1);
    out.push(IpAddr::V4(Ipv4Addr::LOCALHOST));
    out
}

/// The running channel of one bootstrap; dropping it stops its thread (within [`TICK`]) and
/// closes its connections.
pub(crate) struct Liveness {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    reports: Arc<Reports>,
}

/// Peers this rank reports unresponsive, handed to the channel's thread, which sends them
/// (a joiner) or relays them (rank 0).
#[derive(Default)]
pub(crate) struct Reports {
    queue: parking_lot::Mutex<Vec<usize>>,
    /// Reports queued so far, and those the thread has sent on.
    queued: std::sync::atomic::AtomicU64,
    sent: std::sync::atomic::AtomicU64,
}

impl Reports {
    /// Queues `peers` and waits (at most `wait`) until the channel's thread has sent them on:
    /// the caller is about to fail, perhaps to exit.
    pub fn report(&self, peers: &[usize], wait: Duration) {
        if peers.is_empty() {
            return;
        }
        let ticket = {
            let mut q = self.queue.lock();
            q.extend_from_slice(peers);
            self.queued.fetch_add(peers.len() as u64, Ordering::AcqRel) + peers.len() as u64
        };
        let start = Instant::now();
        while self.sent.load(Ordering::Acquire) < ticket && start.elapsed() < wait {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn take(&self) -> Vec<usize> {
        std::mem::take(&mut *self.queue.lock())
    }

    fn done(&self, n: usize) {
        self.sent.fetch_add(n as u64, Ordering::AcqRel);
    }
}

impl Liveness {
    /// Where this rank's reports of unresponsive peers go.
    pub fn reports(&self) -> Arc<Reports> {
        self.reports.clone()
    }
}

impl Drop for Liveness {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Liveness {
    /// Rank 0: listens on an ephemeral port of every address and returns the channel and the
    /// beacon the others need.
    pub fn serve(world: usize, dead: Arc<DeadSet>) -> io::Result<(Liveness, Beacon)> {
        let (listener, v6) = match TcpListener::bind((Ipv6Addr::UNSPECIFIED, 0)) {
            Ok(l) => (l, true),
            Err(_) => (TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))?, false),
        };
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let beacon = Beacon { addrs: host_addrs(v6), port, token: random_bytes::<16>()? };
        let stop = Arc::new(AtomicBool::new(false));
        let token = beacon.token;
        let flag = stop.clone();
        let reports = Arc::new(Reports::default());
        let mine = reports.clone();
        let thread =
            std::thread::Builder::new().name("fep-liveness-0".into()).spawn(move || {
                let conns = Vec::new();
                Server {
                    listener,
                    token,
                    world,
                    dead,
                    conns,
                    reports: mine,
                    relayed: Vec::new(),
                    reporters: Vec::new(),
                    held: HeldReports::default(),
                }
                .run(&flag)
            })?;
        Ok((Liveness { stop, thread: Some(thread), reports }, beacon))
    }

    /// Rank `rank` (not 0): connects to rank 0 in the background and marks what it relays.
    pub fn join(
        rank: usize,
        world: usize,
        beacon: Beacon,
        dead: Arc<DeadSet>,
    ) -> io::Result<Liveness> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let reports = Arc::new(Reports::default());
        let mine = reports.clone();
        let thread = std::thread::Builder::new()
            .name(format!("fep-liveness-{rank}"))
            .spawn(move || joiner(rank, world, &beacon, &dead, &mine, &flag))?;
        Ok(Liveness { stop, thread: Some(thread), reports })
    }
}

struct Conn {
    stream: TcpStream,
    /// The rank it proved, once it did.
    rank: Option<usize>,
    since: Instant,
    input: Vec<u8>,
    output: Vec<u8>,
    closed: bool,
}

struct Server {
    listener: TcpListener,
    token: [u8; 16],
    world: usize,
    dead: Arc<DeadSet>,
    conns: Vec<Conn>,
    /// Rank 0's own reports.
    reports: Arc<Reports>,
    /// Peers already relayed as unresponsive.
    relayed: Vec<usize>,
    /// Ranks that reported (alive), and reports held for their grace.
    reporters: Vec<usize>,
    held: HeldReports,
}

impl Server {
    fn run(mut self, stop: &AtomicBool) {
        while !stop.load(Ordering::Acquire) {
            let mut fds = Vec::with_capacity(self.conns.len() + 1);
            fds.push(libc::pollfd {
                fd: self.listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            for c in &self.conns {
                let out = if c.output.is_empty() { 0 } else { libc::POLLOUT };
                fds.push(libc::pollfd {
                    fd: c.stream.as_raw_fd(),
                    events: libc::POLLIN | out,
                    revents: 0,
                });
            }
            // SAFETY: `fds` is a live array of `fds.len()` pollfd entries for open sockets.
            let n = unsafe {
                let ms = self.poll_wait().as_millis().max(1) as i32;
                libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms)
            };
            if n < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                crate::fep_warn!(
                    target: "fabric_ep::bootstrap",
                    "liveness: poll failed ({}); rank 0 stops relaying departures",
                    io::Error::last_os_error()
                );
                return;
            }
            if fds[0].revents != 0 {
                self.accept();
            }
            for (c, fd) in self.conns.iter_mut().zip(&fds[1..]) {
                if fd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                    read_some(c);
                }
                if fd.revents & libc::POLLOUT != 0 {
                    flush(c);
                }
            }
            self.admit();
            self.take_reports();
            self.reap();
        }
    }

    /// Holds the reports that arrived on proven connections, and rank 0's own, for their
    /// grace; relays those whose grace ended, upstream first (see [`HeldReports`]; a reporter
    /// leaving ends every grace at once).
    fn take_reports(&mut self) {
        let arrived = Instant::now();
        for c in self.conns.iter_mut().filter(|c| !c.closed) {
            let Some(by) = c.rank else { continue };
            let whole = c.input.len() / FRAME_BYTES * FRAME_BYTES;
            for f in c.input[..whole].chunks_exact(FRAME_BYTES) {
                let peer = u64::from_le_bytes(f[1..].try_into().unwrap_or([0xff; 8]));
                if f[0] != K_REPORT || peer >= self.world as u64 {
                    // Not this protocol: the connection goes (its rank is reported gone).
                    c.closed = true;
                    break;
                }
                if !self.reporters.contains(&by) {
                    self.reporters.push(by);
                }
                self.held.push(by, vec![peer as usize], arrived, REPORT_GRACE);
            }
            c.input.drain(..whole);
        }
        let own = self.reports.take();
        if !own.is_empty() && !self.reporters.contains(&0) {
            self.reporters.push(0);
        }
        // An out-of-range peer of rank 0's own is dropped when relayed (counted, never named).
        for p in own {
            self.held.push(0, vec![p.min(self.world)], arrived, REPORT_GRACE);
        }
        let leaving =
            self.conns.iter().any(|c| c.closed && c.rank.is_some_and(|r| self.held.holds_from(r)));
        let due = self.held.take_due(if leaving { None } else { Some(Instant::now()) });
        for Held { by, peers, .. } in due {
            let peer = peers[0];
            let relay = peer < self.world
                && peer != by
                && !self.relayed.contains(&peer)
                && !self.reporters.contains(&peer)
                && !self.dead.is_dead(peer);
            if relay {
                self.relayed.push(peer);
                crate::fep_info!(
                    target: "fabric_ep::bootstrap",
                    "liveness: rank {by} reports rank {peer} unresponsive; telling the other ranks"
                );
                let note = frame(K_STALLED, peer as u64 | (by as u64) << 32);
                for o in self.conns.iter_mut().filter(|o| o.rank.is_some() && !o.closed) {
                    if o.rank != Some(peer) {
                        o.output.extend_from_slice(&note);
                        flush(o);
                    }
                }
                if peer != 0 {
                    self.dead.mark_unresponsive(peer, by);
                }
            }
            if by == 0 {
                self.reports.done(1);
            } else if let Some(o) = self.conns.iter_mut().find(|o| o.rank == Some(by) && !o.closed)
            {
                o.output.extend_from_slice(&frame(K_REPORTED, 0));
                flush(o);
            }
        }
    }

    /// When the poll must wake next: the earliest held report's grace, at most a tick.
    fn poll_wait(&self) -> Duration {
        let now = Instant::now();
        self.held.next_due().map_or(TICK, |at| at.saturating_duration_since(now).min(TICK))
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    let pending = self.conns.iter().filter(|c| c.rank.is_none()).count();
                    if pending >= MAX_PENDING || stream.set_nonblocking(true).is_err() {
                        continue; // dropped: closed
                    }
                    let _ = stream.set_nodelay(true);
                    keepalive(&stream);
                    self.conns.push(Conn {
                        stream,
                        rank: None,
                        since: Instant::now(),
                        input: Vec::new(),
                        output: Vec::new(),
                        closed: false,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return, // WouldBlock (none left), or a transient accept error
            }
        }
    }

    /// Checks the hellos that arrived; welcomes a proven rank with the departures so far.
    fn admit(&mut self) {
        let known: Vec<usize> = self.conns.iter().filter_map(|c| c.rank).collect();
        let mut admitted = Vec::new();
        for c in self.conns.iter_mut().filter(|c| c.rank.is_none() && !c.closed) {
            if c.input.len() < HELLO_BYTES {
                if c.since.elapsed() > HELLO_WAIT {
                    c.closed = true;
                }
                continue;
            }
            let h = &c.input[..HELLO_BYTES];
            let rank = u64::from_le_bytes(h[21..29].try_into().unwrap_or([0xff; 8])) as usize;
            let world = u64::from_le_bytes(h[29..37].try_into().unwrap_or([0xff; 8])) as usize;
            let ok = &h[..4] == MAGIC
                && h[4] == VERSION
                && h[5..21] == self.token
                && world == self.world
                && (1..self.world).contains(&rank)
                && !known.contains(&rank)
                && !admitted.contains(&rank);
            if !ok {
                c.closed = true;
                continue;
            }
            c.rank = Some(rank);
            c.input.drain(..HELLO_BYTES);
            admitted.push(rank);
            c.output.extend_from_slice(&frame(K_WELCOME, 0));
            for r in self.dead.list() {
                c.output.extend_from_slice(&frame(K_LEFT, r as u64));
            }
            flush(c);
        }
    }

    /// Drops closed connections; a proven rank's departure is marked and relayed to the rest.
    fn reap(&mut self) {
        loop {
            let Some(i) = self.conns.iter().position(|c| c.closed) else { return };
            let c = self.conns.swap_remove(i);
            let Some(rank) = c.rank else { continue };
            if self.dead.is_dead(rank) {
                continue;
            }
            crate::fep_info!(
                target: "fabric_ep::bootstrap",
                "liveness: rank {rank}'s connection to rank 0 closed; telling the other ranks"
            );
            // Told before it is marked here: this rank's own waits fail once it is marked, and
            // a rank that exits on that error before the news went out would leave the others
            // naming rank 0 instead of `rank`.
            for o in self.conns.iter_mut().filter(|o| o.rank.is_some() && !o.closed) {
                o.output.extend_from_slice(&frame(K_LEFT, rank as u64));
                flush(o);
            }
            self.dead.mark(rank);
        }
    }
}

fn frame(kind: u8, rank: u64) -> [u8; FRAME_BYTES] {
    let mut f = [0u8; FRAME_BYTES];
    f[0] = kind;
    f[1..].copy_from_slice(&rank.to_le_bytes());
    f
}

/// Reads what a non-blocking connection has; EOF or an error closes it. After its hello a proven
/// joiner sends only reports (parsed each turn); more than [`MAX_INPUT`] unparsed closes it.
fn read_some(c: &mut Conn) {
    let mut buf = [0u8; 256];
    loop {
        match c.stream.read(&mut buf) {
            Ok(0) => {
                c.closed = true;
                return;
            }
            Ok(n) => {
                if c.input.len() + n > MAX_INPUT {
                    c.closed = true;
                    return;
                }
                c.input.extend_from_slice(&buf[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => {
                c.closed = true;
                return;
            }
        }
    }
}

/// Writes what is queued for a non-blocking connection (at most one frame per rank of the job).
fn flush(c: &mut Conn) {
    while !c.output.is_empty() {
        match c.stream.write(&c.output) {
            Ok(0) => {
                c.closed = true;
                return;
            }
            Ok(n) => {
                c.output.drain(..n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => {
                c.closed = true;
                return;
            }
        }
    }
}

/// Tries rank 0's addresses in order; the stream of the first that welcomes this rank.
fn connect(rank: usize, world: usize, beacon: &Beacon, stop: &AtomicBool) -> Option<TcpStream> {
    let mut hello = Vec::with_capacity(HELLO_BYTES);
    hello.extend_from_slice(MAGIC);
    hello.push(VERSION);
    hello.extend_from_slice(&beacon.token);
    hello.extend_from_slice(&(rank as u64).to_le_bytes());
    hello.extend_from_slice(&(world as u64).to_le_bytes());
    for ip in &beacon.addrs {
        if stop.load(Ordering::Acquire) {
            return None;
        }
        let addr = SocketAddr::new(*ip, beacon.port);
        let Ok(mut s) = TcpStream::connect_timeout(&addr, CONNECT_WAIT) else { continue };
        let _ = s.set_nodelay(true);
        if s.set_write_timeout(Some(CONNECT_WAIT)).is_err()
            || s.set_read_timeout(Some(HELLO_WAIT)).is_err()
            || s.write_all(&hello).is_err()
        {
            continue;
        }
        let mut f = [0u8; FRAME_BYTES];
        if s.read_exact(&mut f).is_ok() && f[0] == K_WELCOME {
            keepalive(&s);
            return Some(s);
        }
    }
    None
}

fn joiner(
    rank: usize,
    world: usize,
    beacon: &Beacon,
    dead: &DeadSet,
    reports: &Reports,
    stop: &AtomicBool,
) {
    let Some(mut s) = connect(rank, world, beacon, stop) else {
        // Nothing to send reports on: a reporter does not wait for this thread.
        reports.sent.store(u64::MAX, Ordering::Release);
        if !stop.load(Ordering::Acquire) {
            crate::fep_warn!(
                target: "fabric_ep::bootstrap",
                "liveness: rank {rank} could not reach rank 0 at any of {:?} port {}; a rank \
                 that dies is seen only when a wait on it times out",
                beacon.addrs,
                beacon.port
            );
        }
        return;
    };
    // Short reads: a rank reporting a stalled peer is about to fail and waits for the send.
    if s.set_read_timeout(Some(REPORT_TICK)).is_err() {
        reports.sent.store(u64::MAX, Ordering::Release);
        return;
    }
    let mut pending = Vec::new();
    let mut buf = [0u8; 256];
    while !stop.load(Ordering::Acquire) {
        let out = reports.take();
        if !out.is_empty() {
            let mut w = Vec::with_capacity(out.len() * FRAME_BYTES);
            for &p in &out {
                w.extend_from_slice(&frame(K_REPORT, p as u64));
            }
            // Blocking, bounded by the connection's write timeout (set at connect); each
            // report counts as sent when rank 0 answers it (REPORTED).
            if s.write_all(&w).is_err() {
                reports.done(out.len());
            }
        }
        match s.read(&mut buf) {
            Ok(0) => {
                if !stop.load(Ordering::Acquire) {
                    crate::fep_info!(
                        target: "fabric_ep::bootstrap",
                        "liveness: rank {rank}'s connection to rank 0 closed: rank 0 left"
                    );
                    dead.mark(0);
                }
                reports.sent.store(u64::MAX, Ordering::Release);
                return;
            }
            Ok(n) => {
                pending.extend_from_slice(&buf[..n]);
                let whole = pending.len() / FRAME_BYTES * FRAME_BYTES;
                for f in pending[..whole].chunks_exact(FRAME_BYTES) {
                    let r = u64::from_le_bytes(f[1..].try_into().unwrap_or([0xff; 8]));
                    if f[0] == K_LEFT {
                        // Out-of-range ranks name no peer: DeadSet ignores them.
                        dead.mark(usize::try_from(r).unwrap_or(usize::MAX));
                    } else if f[0] == K_STALLED {
                        let peer = (r & 0xffff_ffff) as usize;
                        // Of itself: it keeps waiting on its own peers (their waits name it).
                        if peer != rank {
                            dead.mark_unresponsive(peer, (r >> 32) as usize);
                        }
                    } else if f[0] == K_REPORTED {
                        reports.done(1);
                    }
                }
                pending.drain(..whole);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => {
                if !stop.load(Ordering::Acquire) {
                    crate::fep_info!(
                        target: "fabric_ep::bootstrap",
                        "liveness: rank {rank}'s connection to rank 0 failed ({e}): rank 0 left"
                    );
                    dead.mark(0);
                }
                reports.sent.store(u64::MAX, Ordering::Release);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beacon_round_trips_and_rejects_what_is_not_one() {
        let b = Beacon {
            addrs: vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7)), IpAddr::V6(Ipv6Addr::LOCALHOST)],
            port: 40123,
            token: [9; 16],
        };
        assert_eq!(Beacon::decode(&b.encode()), Some(b));
        assert_eq!(Beacon::decode(&[0u8; BEACON_BYTES]), None, "an empty slot");
        let mut bad = Beacon { addrs: vec![], port: 1, token: [0; 16] }.encode();
        assert_eq!(Beacon::decode(&bad), None, "no address");
        bad[5] = 200;
        assert_eq!(Beacon::decode(&bad), None, "too many addresses");
        assert_eq!(Beacon::decode(&[1, 2, 3]), None, "short");
    }

    #[test]
    fn host_addrs_end_with_loopback() {
        let a = host_addrs(true);
        assert!(!a.is_empty() && a.len() <= MAX_ADDRS);
        assert_eq!(a.last(), Some(&IpAddr::V4(Ipv4Addr::LOCALHOST)));
    }

    fn wait_for(what: &str, f: impl Fn() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(5), "{what}: not within 5 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_rank_that_leaves_is_relayed_and_rank_0_leaving_is_seen() {
        let world = 4;
        let sets: Vec<Arc<DeadSet>> = (0..world).map(|_| Arc::new(DeadSet::new(world))).collect();
        let (server, beacon) = Liveness::serve(world, sets[0].clone()).expect("serve");
        let mut joiners: Vec<Option<Liveness>> = (1..world)
            .map(|r| Some(Liveness::join(r, world, beacon.clone(), sets[r].clone()).unwrap()))
            .collect();
        // A stranger without the token is refused and changes nothing.
        let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, beacon.port)).expect("connect");
        s.write_all(&[0u8; HELLO_BYTES]).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(s.read(&mut [0u8; 16]).unwrap_or(0), 0, "the stranger is closed");
        // Rank 2 leaves: everyone else names it, nobody else.
        std::thread::sleep(Duration::from_millis(300)); // let the joiners connect
        joiners[1] = None;
        for r in [0, 1, 3] {
            wait_for(&format!("rank {r} names rank 2"), || sets[r].list() == vec![2]);
        }
        // Rank 0 leaves: the others name it.
        drop(server);
        for r in [1, 3] {
            wait_for(&format!("rank {r} names rank 0"), || sets[r].list() == vec![2, 0]);
        }
        drop(joiners);
    }

    #[test]
    fn a_joiner_that_cannot_reach_rank_0_gives_up_quietly() {
        // A port nobody listens on (bound, then released).
        let port =
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port();
        let beacon = Beacon { addrs: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)], port, token: [1; 16] };
        let dead = Arc::new(DeadSet::new(2));
        let j = Liveness::join(1, 2, beacon, dead.clone()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        drop(j);
        assert!(dead.list().is_empty(), "an unreachable rank 0 is not a dead one");
    }
}
