//! The TCP store: rank 0 serves (`server.rs`), every rank (rank 0 included) is a client.
//!
//! One file: `TcpStore` and its client side (handshake, reader thread, reconnects) share the one
//! connection state (`Client`) defined here; the server is already in server.rs.
//!
//! The wire format is in `wire.rs`, the handshake's proofs and the threat model in `auth.rs`.
//! Clients use blocking sockets whose timeouts are re-armed from the deadline before every write;
//! after the handshake a reader thread per store takes every frame off the socket, so that the
//! store's news of a dead peer reaches [`Bootstrap::dead_ranks`] while no collective is running.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::auth::{
    random_bytes, JobSecret, Role, SecretSource, Transcript, MAC_LEN, MIN_SECRET_LEN, NONCE_LEN,
};
use super::server::{self, Instance, ServerConfig};
use super::wire::*;
use super::{
    check_ranks, later, Bootstrap, BootstrapError, DeadPeer, DeadSet, MAX_BLOB, MAX_WORLD,
};

/// Extra time a client gives the store beyond its own deadline to deliver the store's verdict
/// (the store's round deadline is never later than this client's, so normally it answers first).
const ANSWER_GRACE: Duration = Duration::from_secs(2);

/// What a rank says when the other end does not behave like a fabric-ep store.
const NOT_OURS: &str = "it is probably not a fabric-ep store (under torchrun the agent's own store \
     listens on MASTER_PORT; fabric-ep uses MASTER_PORT + 1 unless FEP_MASTER_PORT names a free port)";

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
    /// Names the job in messages; an authenticated peer presenting another id is refused
    /// (`FEP_JOB_ID`, else `TORCHELASTIC_RUN_ID`, else `"none"`).
    pub job_id: String,
    /// What every connection proves it knows (`FEP_JOB_SECRET`, else derived from `job_id`).
    pub secret: JobSecret,
    /// Every rank runs on rank 0's host: the store listens on, and ranks connect to, loopback
    /// only, whatever `addr` says (set from the env when `LOCAL_WORLD_SIZE` equals `WORLD_SIZE`).
    pub loopback: bool,
    /// Bound on construction (connect + handshake) and on each all-gather.
    pub timeout: Duration,
}

impl TcpStoreOptions {
    /// Reads `MASTER_ADDR`, `MASTER_PORT` (the store listens on `MASTER_PORT + 1`, or on
    /// `FEP_MASTER_PORT` when set), `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and `LOCAL_WORLD_SIZE`
    /// (these two default to `RANK` and `WORLD_SIZE`, i.e. one node), the job id from
    /// `FEP_JOB_ID`, else `TORCHELASTIC_RUN_ID`, else `"none"`, and the secret from
    /// `FEP_JOB_SECRET` (at least [`MIN_SECRET_LEN`] bytes), else derived from the job id.
    ///
    /// Under torchrun the agent's own store already listens on `MASTER_PORT`, hence the `+ 1`;
    /// `FEP_MASTER_PORT` picks any other port. An explicit `LOCAL_WORLD_SIZE` equal to
    /// `WORLD_SIZE` says every rank is on this host, so the store stays on loopback.
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
        let (local_world_size, local_given) = match get("LOCAL_WORLD_SIZE") {
            Some(v) => (number("LOCAL_WORLD_SIZE", v)?, true),
            None => (world_size, false),
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
        let secret = match get("FEP_JOB_SECRET") {
            Some(s) if s.len() < MIN_SECRET_LEN => {
                return env(
                    "FEP_JOB_SECRET",
                    format!(
                        "{} bytes is too short to be a secret; give every rank the same random \
                         value of at least {MIN_SECRET_LEN} bytes (e.g. 32 hex digits)",
                        s.len()
                    ),
                )
            }
            Some(s) => JobSecret::new(s.as_bytes()),
            // NOTES: nothing else in torchrun's environment is both common to every rank and
            // unknown to outsiders (see auth.rs): the job id is the best there is.
            None => JobSecret::from_job_id(&job_id),
        };
        // Without an explicit LOCAL_WORLD_SIZE the default (one node) is an assumption, and a
        // PyTorchJob of one rank per pod would be cut off by loopback.
        let loopback = local_given && local_world_size == world_size;
        Ok(TcpStoreOptions {
            addr,
            port,
            rank,
            world_size,
            local_rank,
            local_world_size,
            job_id,
            secret,
            loopback,
            timeout,
        })
    }

    /// The host ranks connect to: loopback for a single-host job, else `addr`.
    fn connect_host(&self) -> &str {
        if self.loopback {
            "127.0.0.1"
        } else {
            &self.addr
        }
    }

    /// `host:port` as it appears in error messages (IPv6 literals bracketed).
    pub fn store_addr(&self) -> String {
        let host = self.connect_host();
        if host.contains(':') {
            format!("[{host}]:{}", self.port)
        } else {
            format!("{host}:{}", self.port)
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

/// The instance number of the next store this process creates as `rank` on `host:port`: the k-th
/// one is instance k on every rank, since every rank creates its stores in the same order.
fn next_instance(host: &str, port: u16, rank: usize) -> u64 {
    static NEXT: Mutex<Vec<(String, u16, usize, u64)>> = Mutex::new(Vec::new());
    let mut next = NEXT.lock();
    match next.iter_mut().find(|(h, p, r, _)| h == host && *p == port && *r == rank) {
        Some((_, _, _, n)) => {
            *n += 1;
            *n - 1
        }
        None => {
            next.push((host.to_string(), port, rank, 1));
            0
        }
    }
}

/// Where rank 0 listens. A single-host job and a loopback `MASTER_ADDR` bind loopback only (local
/// jobs and tests stay off the network); anything else binds all interfaces, as torch's store
/// does, because the name other ranks use (a Kubernetes service, a load balancer) may not be an
/// address of this host. Every connection must still prove the job secret.
fn bind_target(opts: &TcpStoreOptions) -> SocketAddr {
    if opts.loopback {
        return SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), opts.port);
    }
    let first = (opts.addr.as_str(), opts.port).to_socket_addrs().ok().and_then(|mut a| a.next());
    match first {
        Some(sa) if sa.ip().is_loopback() => sa,
        Some(SocketAddr::V6(_)) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), opts.port),
        _ => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), opts.port),
    }
}

/// [`Bootstrap`] over a TCP store served by rank 0.
///
/// Construction returns once this rank's handshake was accepted (rank 0 also opens its instance
/// of the store first); it does not wait for the other ranks: the first collective does, bounded
/// by the timeout. Several stores may live in one process on the same port, at once or one after
/// another: the k-th one created as a given rank meets the k-th one of every other rank.
pub struct TcpStore {
    opts: TcpStoreOptions,
    addr: String,
    instance: u64,
    dead: Arc<DeadSet>,
    // NOTES: field order is drop order: this rank's connection closes before rank 0 closes its
    // instance of the store.
    client: Mutex<Client>,
    server: Option<Instance>,
}

impl TcpStore {
    /// [`TcpStoreOptions::from_env`] then [`TcpStore::new`].
    pub fn from_env(timeout: Duration) -> Result<Self, BootstrapError> {
        Self::new(TcpStoreOptions::from_env(timeout)?)
    }

    /// Joins the store at `opts.addr:opts.port`, opening this process's server there first when
    /// `opts.rank == 0`. Other ranks retry connecting until the timeout, since rank 0 may start
    /// late.
    pub fn new(opts: TcpStoreOptions) -> Result<Self, BootstrapError> {
        Self::with_config(opts, ServerConfig::default())
    }

    /// [`new`](Self::new) with the server's limits on unproven connections (tests shorten them).
    pub(crate) fn with_config(
        opts: TcpStoreOptions,
        cfg: ServerConfig,
    ) -> Result<Self, BootstrapError> {
        opts.validate()?;
        let deadline = later(Instant::now(), opts.timeout);
        let addr = opts.store_addr();
        let host = opts.connect_host().to_string();
        // Counted before anything can fail, so that a failed attempt still keeps every rank's
        // count in step.
        let instance = next_instance(&host, opts.port, opts.rank);
        let server = match opts.rank {
            0 => Some(server::open(
                bind_target(&opts),
                &opts.secret,
                instance,
                opts.world_size,
                &opts.job_id,
                cfg,
                deadline,
                &addr,
            )?),
            _ => None,
        };
        let dead = Arc::new(DeadSet::new(opts.world_size));
        let client =
            Client::connect(&opts, &host, &addr, instance, deadline, &dead, server.as_ref())?;
        Ok(TcpStore { opts, addr, instance, dead, client: Mutex::new(client), server })
    }

    /// The job id this rank presented.
    pub fn job_id(&self) -> &str {
        &self.opts.job_id
    }

    /// Where this rank's secret came from.
    pub fn secret_source(&self) -> SecretSource {
        self.opts.secret.source()
    }

    /// `host:port` of the store.
    pub fn store_addr(&self) -> &str {
        &self.addr
    }

    /// Which of this process's stores on that port this is (0 for the first created as this
    /// rank); the same number on every rank of the job.
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// The bound on each collective.
    pub fn timeout(&self) -> Duration {
        self.opts.timeout
    }

    /// Closes this rank's connection and, on rank 0, this instance of the store (the server
    /// flushes answers already queued, bounded, and stops with its last instance). Dropping does
    /// the same; this form reports a store that failed.
    pub fn close(mut self) -> Result<(), BootstrapError> {
        if let Err(e) = self.client.get_mut().close() {
            return Err(BootstrapError::Io {
                call: "shutdown",
                addr: self.addr.clone(),
                source: e,
            });
        }
        if let Some(server) = self.server.take() {
            let fatal = server.fatal();
            drop(server);
            if let Some(msg) = fatal {
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
        let mut client = self.client.lock();
        client.gather(&self.opts, &self.addr, data, op, self.server.as_ref())
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
    fn dead_ranks(&self) -> Vec<usize> {
        self.dead.list()
    }
    fn is_dead(&self, rank: usize) -> bool {
        self.dead.is_dead(rank)
    }
    fn dead_peers(&self) -> Vec<DeadPeer> {
        self.dead.peers()
    }
    fn report_unresponsive(&self, peers: &[usize]) {
        let me = self.opts.rank;
        let mut named: Vec<u64> = peers
            .iter()
            .filter(|&&p| p != me && p < self.opts.world_size && !self.dead.is_dead(p))
            .map(|&p| p as u64)
            .collect();
        named.sort_unstable();
        named.dedup();
        if named.is_empty() {
            return;
        }
        // A collective of another thread holds the connection for its whole round: then the
        // report is dropped rather than waited for (the caller is on its way to an error).
        let Some(mut client) = self.client.try_lock_for(REPORT_WAIT) else { return };
        client.report_unresponsive(&named);
    }
}

/// The longest a rank spends telling the store which peers stopped responding.
const REPORT_WAIT: Duration = Duration::from_millis(1500);

// ---------------------------------------------------------------------------------------------
// Client side

/// What the reader thread hands to the collective waiting for an answer.
enum Incoming {
    Frame(u8, Vec<u8>),
    /// The connection closed or failed.
    Lost(String),
    /// The store sent something this protocol does not allow.
    Bad(String),
}

/// How a handshake attempt ended without a verdict.
enum Hs {
    /// The connection closed before the store answered: a server that was stopping, or one that
    /// evicted this connection to make room. Worth another connection.
    Retry(String),
    Fatal(BootstrapError),
}

struct Client {
    stream: TcpStream,
    rx: mpsc::Receiver<Incoming>,
    reader: Option<JoinHandle<()>>,
    /// Set before this rank closes the connection itself, so the reader does not take the close
    /// for rank 0's death.
    closing: Arc<AtomicBool>,
    dead: Arc<DeadSet>,
    /// `REPORTED` answers the reader has seen.
    reported: Arc<std::sync::atomic::AtomicU64>,
    next_round: u64,
    /// Set once the stream may be out of step with the store (an I/O error mid-frame, a missed
    /// answer); every later call reports it instead of reading garbage.
    broken: Option<String>,
}

impl Client {
    /// Connects and runs the handshake, reconnecting (until `deadline`) when the store closes the
    /// connection before its verdict; then starts the reader thread.
    fn connect(
        opts: &TcpStoreOptions,
        host: &str,
        addr: &str,
        ns: u64,
        deadline: Instant,
        dead: &Arc<DeadSet>,
        server: Option<&Instance>,
    ) -> Result<Client, BootstrapError> {
        let with_fatal = |detail: String| match server.and_then(Instance::fatal) {
            Some(msg) => format!("{detail} (the store thread in this process failed: {msg})"),
            None => detail,
        };
        let mut backoff = Duration::from_millis(20);
        let mut retried: Option<String> = None;
        let stream = loop {
            let stream = match connect_until(host, opts.port, addr, deadline) {
                Ok(s) => s,
                Err(e) => {
                    let Some(why) = retried else { return Err(e) };
                    let detail = format!(
                        "the store kept closing the connection during the handshake (last: \
                         {why}) until the timeout; {NOT_OURS}"
                    );
                    return Err(BootstrapError::StoreLost {
                        addr: addr.to_string(),
                        op: "connect",
                        detail: with_fatal(detail),
                    });
                }
            };
            keepalive(&stream);
            match handshake(&stream, opts, ns, addr, deadline) {
                Ok(()) => break stream,
                Err(Hs::Fatal(BootstrapError::StoreLost { addr, op, detail })) => {
                    return Err(BootstrapError::StoreLost { addr, op, detail: with_fatal(detail) })
                }
                Err(Hs::Fatal(e)) => return Err(e),
                Err(Hs::Retry(why)) => {
                    retried = Some(why);
                    thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
            }
        };
        let io_err = |call: &'static str| {
            let addr = addr.to_string();
            move |source| BootstrapError::Io { call, addr, source }
        };
        let rx_stream = stream.try_clone().map_err(io_err("duplicate the connection to"))?;
        let (tx, rx) = mpsc::channel();
        let closing = Arc::new(AtomicBool::new(false));
        let reported = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let reader = {
            let (dead, closing, acks) = (Arc::clone(dead), Arc::clone(&closing), reported.clone());
            let rank = opts.rank;
            thread::Builder::new()
                .name("fep-bootstrap-rx".into())
                .spawn(move || read_loop(rx_stream, tx, dead, closing, acks, rank))
                .map_err(io_err("spawn the reader thread for the connection to"))?
        };
        Ok(Client {
            stream,
            rx,
            reader: Some(reader),
            closing,
            dead: Arc::clone(dead),
            reported,
            next_round: 0,
            broken: None,
        })
    }

    /// Shuts the connection (which wakes the reader) and joins the reader. Idempotent.
    fn close(&mut self) -> io::Result<()> {
        let Some(reader) = self.reader.take() else { return Ok(()) };
        self.closing.store(true, Ordering::Release);
        if let Err(e) = self.stream.shutdown(std::net::Shutdown::Both) {
            // Not connected: the reader already saw the connection end. Anything else: the
            // reader may not wake, so it is left detached rather than waited on (it ends when the
            // store closes its side).
            if e.kind() != io::ErrorKind::NotConnected && !reader.is_finished() {
                return Err(e);
            }
        }
        let _ = reader.join();
        Ok(())
    }

    fn lost(
        &mut self,
        addr: &str,
        op: &'static str,
        detail: String,
        server: Option<&Instance>,
    ) -> BootstrapError {
        let detail = match server.and_then(Instance::fatal) {
            Some(msg) => format!("{detail} (the store thread in this process failed: {msg})"),
            None => detail,
        };
        self.broken = Some(detail.clone());
        BootstrapError::StoreLost { addr: addr.to_string(), op, detail }
    }

    /// Sends `UNRESPONSIVE` (bounded by [`REPORT_WAIT`]); a write that fails or runs out
    /// leaves the connection marked broken, as a collective's would.
    /// Then waits (same bound) for the store's `REPORTED`: what it relays reaches the others
    /// before this rank's leaving does.
    fn report_unresponsive(&mut self, ranks: &[u64]) {
        if self.broken.is_some() {
            return;
        }
        let mut payload = (ranks.len() as u64).to_le_bytes().to_vec();
        for r in ranks {
            payload.extend_from_slice(&r.to_le_bytes());
        }
        let msg = frame(K_UNRESPONSIVE, &[&payload]);
        let by = later(Instant::now(), REPORT_WAIT);
        let before = self.reported.load(Ordering::Acquire);
        if write_all_by(&self.stream, &msg, by).is_err() {
            self.broken = Some("reporting unresponsive ranks did not finish".into());
            return;
        }
        while self.reported.load(Ordering::Acquire) == before && Instant::now() < by {
            thread::sleep(Duration::from_millis(1));
        }
    }

    fn gather(
        &mut self,
        opts: &TcpStoreOptions,
        addr: &str,
        data: &[u8],
        op: &'static str,
        server: Option<&Instance>,
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
        match write_all_by(&self.stream, &msg, deadline) {
            Ok(()) => {}
            Err(Wire::TimedOut) => {
                let detail =
                    format!("sending round {round} did not finish within {:?}", opts.timeout);
                return Err(self.lost(addr, op, detail, server));
            }
            Err(Wire::Closed(e)) => {
                return Err(self.lost(addr, op, format!("sending round {round}: {e}"), server))
            }
            Err(Wire::Bad(m)) => return Err(BootstrapError::Protocol(m)),
        }
        let answer_by = later(deadline, ANSWER_GRACE);
        let (kind, payload) = self.recv(addr, op, round, answer_by, server)?;
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
                    let (kind, blob) = self.recv(addr, op, round, transfer_by, server)?;
                    if kind != K_BLOB {
                        self.broken = Some(format!("frame kind {kind} inside a result"));
                        return Err(bad(format!("expected a blob frame, got kind {kind}")));
                    }
                    blobs.push(blob);
                }
                Ok(blobs)
            }
            K_FAILED => {
                let err = failure(op, start.elapsed(), opts.world_size, &mut f).unwrap_or_else(bad);
                if let BootstrapError::PeerGone { rank, .. } = &err {
                    self.dead.mark(*rank);
                }
                Err(err)
            }
            other => {
                self.broken = Some(format!("unexpected frame kind {other}"));
                Err(bad(format!("unexpected frame kind {other}")))
            }
        }
    }

    fn recv(
        &mut self,
        addr: &str,
        op: &'static str,
        round: u64,
        deadline: Instant,
        server: Option<&Instance>,
    ) -> Result<(u8, Vec<u8>), BootstrapError> {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.rx.recv_timeout(left) {
            Ok(Incoming::Frame(kind, payload)) => Ok((kind, payload)),
            Ok(Incoming::Lost(e)) => {
                let detail = format!("connection closed while waiting for round {round} ({e})");
                Err(self.lost(addr, op, detail, server))
            }
            Ok(Incoming::Bad(m)) => {
                self.broken = Some(m.clone());
                Err(BootstrapError::Protocol(format!("{op} round {round} from {addr}: {m}")))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let detail = format!("no answer for round {round} by the deadline (store hung?)");
                Err(self.lost(addr, op, detail, server))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let detail = "the connection's reader had already stopped".to_string();
                Err(self.lost(addr, op, detail, server))
            }
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// The reader thread: news of dead peers goes straight to `dead`; everything else, in order, to
/// the collective waiting on `tx`. Ends when the connection does.
fn read_loop(
    stream: TcpStream,
    tx: mpsc::Sender<Incoming>,
    dead: Arc<DeadSet>,
    closing: Arc<AtomicBool>,
    reported: Arc<std::sync::atomic::AtomicU64>,
    rank: usize,
) {
    loop {
        match read_frame(&stream, None, MAX_FRAME) {
            Ok((K_PEER_GONE, payload)) => match Fields::new(&payload, "peer gone").usize() {
                Ok(r) => dead.mark(r),
                Err(m) => {
                    let _ = tx.send(Incoming::Bad(m));
                    return;
                }
            },
            Ok((K_REPORTED, _)) => {
                reported.fetch_add(1, Ordering::AcqRel);
            }
            Ok((K_PEER_UNRESPONSIVE, payload)) => {
                let mut f = Fields::new(&payload, "peer unresponsive");
                match (f.usize(), f.usize()) {
                    // A rank reported of itself is alive as far as it can tell: it keeps
                    // waiting on its own peers (their waits name it).
                    (Ok(r), Ok(_)) if r == rank => {}
                    (Ok(r), Ok(by)) => dead.mark_unresponsive(r, by),
                    (Err(m), _) | (_, Err(m)) => {
                        let _ = tx.send(Incoming::Bad(m));
                        return;
                    }
                }
            }
            Ok((kind, payload)) => {
                if tx.send(Incoming::Frame(kind, payload)).is_err() {
                    return;
                }
            }
            Err(Wire::Closed(e)) => {
                // The store is rank 0's: losing it without having closed it ourselves means rank
                // 0 (or its instance of the store) is gone.
                if rank != 0 && !closing.load(Ordering::Acquire) {
                    dead.mark(0);
                }
                let _ = tx.send(Incoming::Lost(e.to_string()));
                return;
            }
            Err(Wire::Bad(m)) => {
                let _ = tx.send(Incoming::Bad(m));
                return;
            }
            Err(Wire::TimedOut) => {} // no deadline: cannot happen, keep reading
        }
    }
}

/// One handshake on a fresh connection: hello, challenge, proof, verdict (see `wire.rs`).
fn handshake(
    stream: &TcpStream,
    opts: &TcpStoreOptions,
    ns: u64,
    addr: &str,
    deadline: Instant,
) -> Result<(), Hs> {
    let client_nonce = random_bytes::<NONCE_LEN>().map_err(|source| {
        Hs::Fatal(BootstrapError::Io {
            call: "getrandom for the handshake with",
            addr: addr.into(),
            source,
        })
    })?;
    let (rank, world) = (opts.rank as u64, opts.world_size as u64);
    let hello = frame(
        K_HELLO,
        &[
            &MAGIC,
            &PROTOCOL_VERSION.to_le_bytes(),
            &rank.to_le_bytes(),
            &world.to_le_bytes(),
            &str_field(""),
            &ns.to_le_bytes(),
            &client_nonce,
        ],
    );
    send_hs(stream, &hello, deadline, addr, "the hello")?;
    let no_answer = format!("no answer to the hello within the timeout; {NOT_OURS}");
    let (kind, payload) = recv_hs(stream, deadline, addr, "the hello", no_answer)?;
    let bad = |m: String| {
        Hs::Fatal(BootstrapError::Protocol(format!(
            "answer to the hello from {addr}: {m}; {NOT_OURS}"
        )))
    };
    let mut f = Fields::new(&payload, "challenge");
    let server_nonce = match kind {
        K_CHALLENGE => {
            let v = f.u32().map_err(bad)?;
            if v != PROTOCOL_VERSION {
                return Err(bad(format!(
                    "challenge for protocol v{v}, this rank speaks v{PROTOCOL_VERSION}"
                )));
            }
            f.array::<NONCE_LEN>().map_err(bad)?
        }
        K_REFUSE => {
            return Err(Hs::Fatal(
                refusal(opts, addr, ns, &mut f).unwrap_or_else(BootstrapError::Protocol),
            ))
        }
        other => return Err(bad(format!("unexpected frame kind {other}"))),
    };
    let t = Transcript {
        server_nonce: &server_nonce,
        client_nonce: &client_nonce,
        instance: ns,
        rank,
        world,
        job_id: &opts.job_id,
    };
    let proof = frame(K_PROOF, &[&opts.secret.prove(Role::Rank, &t), &str_field(&opts.job_id)]);
    send_hs(stream, &proof, deadline, addr, "the proof")?;
    let no_verdict = format!(
        "the store took this rank's proof of the job secret but gave no verdict within the \
         timeout: rank 0 has not opened instance {ns} of its store (rank 0 is late or hung, or \
         it created fewer stores/Buffers on this port than this rank)"
    );
    let (kind, payload) = recv_hs(stream, deadline, addr, "the proof", no_verdict)?;
    let mut f = Fields::new(&payload, "verdict");
    match kind {
        K_WELCOME => {
            let tag = f.array::<MAC_LEN>().map_err(bad)?;
            if opts.secret.check(Role::Store, &t, &tag) {
                Ok(())
            } else {
                Err(Hs::Fatal(BootstrapError::Auth {
                    addr: addr.to_string(),
                    detail: "the store's welcome does not prove it knows this job's secret: \
                             whatever listens there is not this job's store"
                        .into(),
                }))
            }
        }
        K_REFUSE => {
            Err(Hs::Fatal(refusal(opts, addr, ns, &mut f).unwrap_or_else(BootstrapError::Protocol)))
        }
        other => Err(bad(format!("unexpected frame kind {other}"))),
    }
}

fn send_hs(
    stream: &TcpStream,
    msg: &[u8],
    deadline: Instant,
    addr: &str,
    what: &str,
) -> Result<(), Hs> {
    match write_all_by(stream, msg, deadline) {
        Ok(()) => Ok(()),
        Err(Wire::Closed(e)) => Err(Hs::Retry(format!("sending {what}: {e}"))),
        Err(Wire::TimedOut) => Err(Hs::Fatal(BootstrapError::StoreLost {
            addr: addr.to_string(),
            op: "connect",
            detail: format!("sending {what} timed out"),
        })),
        Err(Wire::Bad(m)) => Err(Hs::Fatal(BootstrapError::Protocol(m))),
    }
}

fn recv_hs(
    stream: &TcpStream,
    deadline: Instant,
    addr: &str,
    what: &str,
    on_timeout: String,
) -> Result<(u8, Vec<u8>), Hs> {
    match read_frame(stream, Some(deadline), REPLY_MAX_FRAME) {
        Ok(f) => Ok(f),
        Err(Wire::Closed(e)) => {
            Err(Hs::Retry(format!("the store closed the connection before answering {what} ({e})")))
        }
        Err(Wire::TimedOut) => Err(Hs::Fatal(BootstrapError::StoreLost {
            addr: addr.to_string(),
            op: "connect",
            detail: on_timeout,
        })),
        Err(Wire::Bad(m)) => Err(Hs::Fatal(BootstrapError::Protocol(format!(
            "answer to {what} from {addr}: {m}; {NOT_OURS}"
        )))),
    }
}

/// Turns a `REFUSE` payload into the error the refused rank reports.
fn refusal(
    opts: &TcpStoreOptions,
    addr: &str,
    ns: u64,
    f: &mut Fields<'_>,
) -> Result<BootstrapError, String> {
    Ok(match f.u8()? {
        REFUSE_AUTH => BootstrapError::Auth {
            addr: addr.to_string(),
            detail: match opts.secret.source() {
                SecretSource::Explicit => "the store refused this rank's proof of FEP_JOB_SECRET: \
                     it belongs to another job, or FEP_JOB_SECRET differs between ranks"
                    .to_string(),
                SecretSource::JobId => format!(
                    "the store refused this rank's proof of the job secret, which is derived from \
                     job id '{}' since FEP_JOB_SECRET is not set: the store belongs to another job, \
                     or FEP_JOB_ID/TORCHELASTIC_RUN_ID (or FEP_JOB_SECRET) differ between ranks",
                    opts.job_id
                ),
            },
        },
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
                 or a stale process of an earlier run with the same job secret)"
            ),
        },
        REFUSE_VERSION => BootstrapError::Protocol(format!(
            "the store at {addr} speaks bootstrap protocol v{}, this rank v{PROTOCOL_VERSION}: \
             all ranks must run the same fabric-ep build",
            f.u32()?
        )),
        REFUSE_CLOSED => BootstrapError::Protocol(format!(
            "the store at {addr} already closed instance {ns}: rank 0 created and closed that \
             store (Buffer) before this rank joined it (its creation failed on rank 0, or this \
             rank created more stores on this port than rank 0)"
        )),
        code => return Err(format!("unknown refusal code {code}")),
    })
}

/// Turns a `FAILED` payload into this rank's error.
pub(super) fn failure(
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
            let note = if f.is_empty() { String::new() } else { f.string()? };
            BootstrapError::Timeout { op, round, missing, waited, note }
        }
        FAIL_GONE => BootstrapError::PeerGone { rank: f.usize()?, op },
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::io::{Read, Write};
    use std::net::TcpListener;

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
        assert_eq!(o.secret, JobSecret::from_job_id("none"));
        assert_eq!(o.secret.source(), SecretSource::JobId);
        assert!(!o.loopback, "an implied LOCAL_WORLD_SIZE must not cut other hosts off");
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
        assert_eq!(o.secret, JobSecret::from_job_id("elastic"));
        assert!(!o.loopback);
        let vars = with(&[("TORCHELASTIC_RUN_ID", "elastic"), ("FEP_JOB_ID", "fep")]);
        let o = TcpStoreOptions::from_lookup(lookup(&vars), Duration::from_secs(1)).expect("opts");
        assert_eq!(o.job_id, "fep");
        let vars = with(&[("FEP_JOB_SECRET", "0123456789abcdef0123"), ("LOCAL_WORLD_SIZE", "8")]);
        let o = TcpStoreOptions::from_lookup(lookup(&vars), Duration::from_secs(1)).expect("opts");
        assert_eq!(o.secret, JobSecret::new(b"0123456789abcdef0123"));
        assert_eq!(o.secret.source(), SecretSource::Explicit);
        assert!(o.loopback, "every rank on this host");
        assert_eq!(o.store_addr(), "127.0.0.1:29501");
        assert_eq!(bind_target(&o), "127.0.0.1:29501".parse().expect("addr"));
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
            ("FEP_JOB_SECRET", "short", "FEP_JOB_SECRET"),
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

    const SECRET: &[u8] = b"unit-test-secret-0123456789";

    fn opts(port: u16, rank: usize, world: usize, job: &str, timeout_ms: u64) -> TcpStoreOptions {
        TcpStoreOptions {
            addr: "127.0.0.1".into(),
            port,
            rank,
            world_size: world,
            local_rank: rank,
            local_world_size: world,
            job_id: job.into(),
            secret: JobSecret::new(SECRET),
            loopback: true,
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    fn free_port() -> u16 {
        super::super::launch::free_port().expect("port")
    }

    fn deadline_in(ms: u64) -> Instant {
        later(Instant::now(), Duration::from_millis(ms))
    }

    /// A rank's handshake by hand, without the reader thread, so a test can drive the raw socket.
    fn raw_join(o: &TcpStoreOptions, ns: u64) -> TcpStream {
        let deadline = deadline_in(5000);
        let stream = connect_until("127.0.0.1", o.port, "test", deadline).expect("connect");
        match handshake(&stream, o, ns, "test", deadline) {
            Ok(()) => stream,
            Err(Hs::Retry(m)) => panic!("handshake closed: {m}"),
            Err(Hs::Fatal(e)) => panic!("handshake failed: {e}"),
        }
    }

    /// Reads until EOF or `within`; true if the store closed the connection in time.
    fn closed_within(mut s: &TcpStream, within: Duration) -> bool {
        let until = Instant::now() + within;
        let mut buf = [0u8; 256];
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            s.set_read_timeout(Some(left)).expect("timeout");
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                {
                    return false
                }
                Err(_) => return true,
            }
        }
    }

    fn hello_bytes(version: u32, rank: u64, world: u64, ns: u64) -> Vec<u8> {
        frame(
            K_HELLO,
            &[
                &MAGIC,
                &version.to_le_bytes(),
                &rank.to_le_bytes(),
                &world.to_le_bytes(),
                &str_field(""),
                &ns.to_le_bytes(),
                &[9u8; 32],
            ],
        )
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
        // Another job (its own derived secret) learns nothing, not even the job id.
        let mut other = opts(port, 1, 2, "job-b", 3000);
        other.secret = JobSecret::from_job_id("job-b");
        match TcpStore::new(other) {
            Err(BootstrapError::Auth { detail, .. }) => {
                assert!(detail.contains("'job-b'") && !detail.contains("job-a"), "{detail}")
            }
            other => panic!("expected Auth, got {:?}", other.err()),
        }
        // A job given the same secret is told the id apart, after proving it. (Rank 2 of a world
        // of 3: this process's rank-1 count already moved on, and a second rank 0 here would be
        // a new instance of this process's server, not a stranger.)
        match TcpStore::new(opts(port, 2, 3, "job-b", 3000)) {
            Err(BootstrapError::JobIdMismatch { ours, theirs, .. }) => {
                assert_eq!((ours.as_str(), theirs.as_str()), ("job-b", "job-a"));
            }
            other => panic!("expected JobIdMismatch, got {:?}", other.err()),
        }
        // Garbage on the port must not disturb the job either.
        let mut junk = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let _ = junk.write_all(b"GET / HTTP/1.0\r\n\r\n");
        assert_eq!(s0.all_gather(b"ok").expect("still fine"), vec![b"ok".to_vec()]);
        assert!(closed_within(&junk, Duration::from_secs(3)), "garbage is dropped");
        s0.close().expect("close");
    }

    #[test]
    fn stranger_with_the_job_id_cannot_claim_a_rank_or_read_blobs() {
        let port = free_port();
        let s0 = TcpStore::new(opts(port, 0, 2, "job", 5000)).expect("rank 0");
        // The stranger knows the job id, instance and world but not the secret; it claims rank 1
        // first and holds the connection open.
        let mut stranger = opts(port, 1, 2, "job", 3000);
        stranger.secret = JobSecret::new(b"a-guess-at-the-secret");
        let deadline = deadline_in(3000);
        let s = connect_until("127.0.0.1", port, "t", deadline).expect("connect");
        match handshake(&s, &stranger, 0, "t", deadline) {
            Err(Hs::Fatal(BootstrapError::Auth { .. })) => {}
            Err(Hs::Fatal(e)) => panic!("expected Auth, got {e}"),
            Err(Hs::Retry(m)) => panic!("expected Auth, got a close: {m}"),
            Ok(()) => panic!("a stranger was welcomed"),
        }
        assert!(closed_within(&s, Duration::from_secs(3)), "refused connections close");
        // A second stranger parks mid-handshake (hello sent, no proof) during the whole job.
        let mut parked = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        parked.write_all(&hello_bytes(PROTOCOL_VERSION, 1, 2, 0)).expect("hello");
        let real = thread::spawn(move || {
            let s1 = TcpStore::new(opts(port, 1, 2, "job", 5000))?;
            s1.all_gather(b"one")
        });
        let got = s0.all_gather(b"zero").expect("rank 0");
        assert_eq!(got, vec![b"zero".to_vec(), b"one".to_vec()]);
        assert_eq!(real.join().expect("thread").expect("rank 1"), got);
        // The parked one got a challenge and nothing else.
        let (kind, _) =
            read_frame(&parked, Some(deadline_in(2000)), REPLY_MAX_FRAME).ok().expect("challenge");
        assert_eq!(kind, K_CHALLENGE);
        parked.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
        assert!(parked.read(&mut [0u8; 16]).is_err(), "nothing more for a stranger");
    }

    #[test]
    fn unproven_connections_are_dropped_after_the_deadline_and_capped() {
        let port = free_port();
        let cfg = ServerConfig { handshake: Duration::from_millis(400), pending_min: 4 };
        let s0 = TcpStore::with_config(opts(port, 0, 2, "cap", 8000), cfg).expect("rank 0");
        // Silent, and stalled after the hello: both gone after the handshake deadline.
        let t0 = Instant::now();
        let silent = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let mut stalled = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stalled.write_all(&hello_bytes(PROTOCOL_VERSION, 1, 2, 0)).expect("hello");
        assert!(closed_within(&silent, Duration::from_secs(3)), "silent one kept");
        assert!(closed_within(&stalled, Duration::from_secs(3)), "stalled one kept");
        assert!(t0.elapsed() >= Duration::from_millis(350), "dropped before the deadline");
        // A flood beyond the cap evicts the oldest, and the real rank still gets in.
        let flood: Vec<TcpStream> =
            (0..12).map(|_| TcpStream::connect(("127.0.0.1", port)).expect("connect")).collect();
        thread::sleep(Duration::from_millis(100));
        let s1 = TcpStore::with_config(opts(port, 1, 2, "cap", 8000), cfg).expect("rank 1");
        let h = thread::spawn(move || s1.barrier());
        s0.barrier().expect("rank 0 barrier");
        h.join().expect("thread").expect("rank 1 barrier");
        let evicted =
            flood[..8].iter().filter(|s| closed_within(s, Duration::from_millis(50))).count();
        assert!(evicted >= 7, "only {evicted} of the oldest 8 evicted under a cap of 4");
    }

    #[test]
    fn wrong_world_or_duplicate_rank_is_refused_alone() {
        let port = free_port();
        let s0 = TcpStore::new(opts(port, 0, 2, "alone", 5000)).expect("rank 0");
        // Hand-made claims for instance 0 (TcpStore::new would count instances, and validate()
        // would reject rank 5 locally): proven, but wrong, so refused one by one.
        let claim = |o: TcpStoreOptions| {
            let deadline = deadline_in(3000);
            let s = connect_until("127.0.0.1", port, "t", deadline).expect("connect");
            match handshake(&s, &o, 0, "t", deadline) {
                Err(Hs::Fatal(e)) => e,
                Err(Hs::Retry(m)) => panic!("closed without a verdict: {m}"),
                Ok(()) => panic!("a wrong claim was welcomed"),
            }
        };
        match claim(opts(port, 1, 3, "alone", 3000)) {
            BootstrapError::WorldSizeMismatch { ours: 3, theirs: 2, rank: 1 } => {}
            other => panic!("expected WorldSizeMismatch, got {other}"),
        }
        match claim(TcpStoreOptions { rank: 5, ..opts(port, 1, 2, "alone", 3000) }) {
            BootstrapError::BadRank { rank: 5, world_size: 2, .. } => {}
            other => panic!("expected BadRank, got {other}"),
        }
        let s1 =
            TcpStore::new(opts(port, 1, 2, "alone", 5000)).expect("the real rank 1 still joins");
        match claim(opts(port, 1, 2, "alone", 3000)) {
            BootstrapError::BadRank { rank: 1, .. } => {}
            other => panic!("expected BadRank for the duplicate, got {other}"),
        }
        let h = thread::spawn(move || s1.all_gather(b"b"));
        assert_eq!(s0.all_gather(b"a").expect("job goes on"), vec![b"a".to_vec(), b"b".to_vec()]);
        h.join().expect("thread").expect("rank 1");
    }

    #[test]
    fn timeout_names_what_the_store_refused() {
        let port = free_port();
        let s0 = TcpStore::new(opts(port, 0, 2, "note", 700)).expect("rank 0");
        assert!(TcpStore::new(opts(port, 1, 4, "note", 3000)).is_err());
        match s0.barrier() {
            Err(e @ BootstrapError::Timeout { .. }) => {
                let BootstrapError::Timeout { missing, note, .. } = &e else { unreachable!() };
                assert_eq!(missing, &vec![1]);
                assert!(note.contains("WORLD_SIZE=4"), "{e}");
                assert!(e.to_string().contains("WORLD_SIZE=4"), "{e}");
            }
            other => panic!("expected Timeout, got {other:?}"),
        }
    }

    #[test]
    fn store_delivers_the_last_round_after_rank_0_leaves() {
        let port = free_port();
        let big = |r: usize| vec![r as u8 + 1; 8 << 20];
        let s0 = TcpStore::new(opts(port, 0, 2, "drain", 10_000)).expect("rank 0");
        // Rank 1 by hand, so that it can be slow to read its 16 MiB result.
        let o1 = opts(port, 1, 2, "drain", 10_000);
        let c1 = raw_join(&o1, s0.instance());
        let deadline = deadline_in(10_000);
        let msg = frame(K_CONTRIBUTE, &[&0u64.to_le_bytes(), &10_000u64.to_le_bytes(), &big(1)]);
        let writer = thread::spawn(move || {
            write_all_by(&c1, &msg, deadline).map_err(|_| "write").map(|()| c1)
        });
        assert_eq!(s0.all_gather(&big(0)).expect("rank 0 gather").len(), 2);
        let reader = thread::spawn(move || {
            let c1 = writer.join().expect("thread").expect("rank 1 contributed");
            thread::sleep(Duration::from_millis(300));
            let mut frames = Vec::new();
            for _ in 0..3 {
                frames.push(read_frame(&c1, Some(deadline), MAX_FRAME).ok().expect("frame"));
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
    fn instances_share_the_port_at_once_and_in_turn() {
        let port = free_port();
        let world = 3;
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                thread::spawn(move || -> Result<(), BootstrapError> {
                    // Two alive at once, used interleaved: each sees only its own blobs.
                    let a = TcpStore::new(opts(port, rank, world, "ns", 5000))?;
                    let b = TcpStore::new(opts(port, rank, world, "ns", 5000))?;
                    assert_eq!((a.instance() + 1, b.instance()), (1, 1));
                    for round in 0..3u8 {
                        let ga = a.all_gather(&[b'a', rank as u8, round])?;
                        let gb = b.all_gather(&[b'b', rank as u8, round])?;
                        for r in 0..world {
                            assert_eq!(
                                (ga[r].clone(), gb[r].clone()),
                                (vec![b'a', r as u8, round], vec![b'b', r as u8, round])
                            );
                        }
                    }
                    drop(a);
                    b.barrier()?;
                    drop(b);
                    // Then one after another, with rank-dependent jitter on who leaves first.
                    for i in 0..10u8 {
                        let s = TcpStore::new(opts(port, rank, world, "ns", 5000))?;
                        let got = s.all_gather(&[i, rank as u8])?;
                        assert_eq!(got, (0..world).map(|r| vec![i, r as u8]).collect::<Vec<_>>());
                        thread::sleep(Duration::from_millis(
                            ((rank * 7 + i as usize * 3) % 11) as u64,
                        ));
                    }
                    Ok(())
                })
            })
            .collect();
        for (rank, h) in handles.into_iter().enumerate() {
            h.join().expect("thread").unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        }
    }

    #[test]
    fn a_closed_peer_is_pushed_to_every_rank_at_once() {
        let port = free_port();
        let world = 3;
        let stores: Vec<TcpStore> = {
            let hs: Vec<_> = (0..world)
                .map(|r| thread::spawn(move || TcpStore::new(opts(port, r, world, "dead", 10_000))))
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread").expect("join")).collect()
        };
        let mut stores = stores.into_iter();
        let (s0, s1, s2) = (stores.next().unwrap(), stores.next().unwrap(), stores.next().unwrap());
        // Everyone has joined once the first barrier completes.
        let (h1, h2) = (
            thread::spawn(move || s1.barrier().map(|()| s1)),
            thread::spawn(move || s2.barrier().map(|()| s2)),
        );
        s0.barrier().expect("barrier");
        let s1 = h1.join().expect("thread").expect("barrier 1");
        drop(h2.join().expect("thread").expect("barrier 2")); // rank 2 leaves
        let t0 = Instant::now();
        while !(s0.is_dead(2) && s1.is_dead(2)) && t0.elapsed() < Duration::from_secs(2) {
            thread::sleep(Duration::from_millis(1));
        }
        assert_eq!((s0.dead_ranks(), s1.dead_ranks()), (vec![2], vec![2]), "not seen in 2 s");
        assert!(!s1.is_dead(0) && !s1.is_dead(1));
        // And a rank blocked in a collective hears it by name, not at the timeout.
        let t1 = Instant::now();
        match s1.barrier() {
            Err(BootstrapError::PeerGone { rank: 2, .. }) => {}
            other => panic!("expected PeerGone(2), got {other:?}"),
        }
        assert!(t1.elapsed() < Duration::from_secs(2));
        // Rank 0 leaving is seen by rank 1 too (its store is gone).
        drop(s0);
        let t2 = Instant::now();
        while !s1.is_dead(0) && t2.elapsed() < Duration::from_secs(2) {
            thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(s1.dead_ranks(), vec![2, 0]);
    }

    /// `world` stores of one job on a fresh port, every rank joined (one barrier done).
    fn joined(world: usize, job: &'static str) -> Vec<TcpStore> {
        let port = free_port();
        let hs: Vec<_> = (0..world)
            .map(|r| thread::spawn(move || TcpStore::new(opts(port, r, world, job, 10_000))))
            .collect();
        let stores: Vec<TcpStore> =
            hs.into_iter().map(|h| h.join().expect("thread").expect("join")).collect();
        thread::scope(|sc| {
            let hs: Vec<_> = stores.iter().map(|st| sc.spawn(move || st.barrier())).collect();
            for h in hs {
                h.join().expect("thread").expect("barrier");
            }
        });
        stores
    }

    /// A rank that timed out on a stopped peer says so before it leaves: every rank then names
    /// the stopped rank first (reported by whom), and the reporter's leaving second. Reports of
    /// itself, of a rank already named, or out of range name no one; the store stays up.
    #[test]
    fn an_unresponsive_peer_reported_by_one_rank_reaches_every_rank_first() {
        let mut it = joined(4, "stall").into_iter();
        let (s0, s1, s2, s3) =
            (it.next().unwrap(), it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        s2.report_unresponsive(&[2, 1, 1, 99]);
        let t0 = Instant::now();
        let wait = |s: &TcpStore, n: usize| {
            while s.dead_peers().len() < n && t0.elapsed() < Duration::from_secs(2) {
                thread::sleep(Duration::from_millis(1));
            }
        };
        let stalled = DeadPeer { rank: 1, reported_by: Some(2) };
        // The report returns once the store relayed it (after its grace).
        for s in [&s0, &s3] {
            wait(s, 1);
            assert_eq!(s.dead_peers(), vec![stalled], "rank {}", s.rank());
        }
        // Rank 1 hears it of itself and keeps waiting on its own peers.
        assert!(s1.dead_peers().is_empty());
        // A second report of the same rank by another is not relayed again.
        s3.report_unresponsive(&[1]);
        drop(s2);
        for s in [&s0, &s3] {
            wait(s, 2);
            assert_eq!(s.dead_peers(), vec![stalled, DeadPeer { rank: 2, reported_by: None }]);
        }
        assert_eq!(s0.dead_ranks(), vec![1, 2]);
    }

    /// In a cascade (rank 3 times out on ranks 0 and 1, rank 0 on rank 1 a moment later), the
    /// rank that reports within the grace is alive and is not relayed: only the stopped rank is,
    /// as rank 0's report (the one further up: rank 3's names rank 0) says.
    #[test]
    fn a_rank_that_reports_within_the_grace_is_not_relayed() {
        let stores: Vec<Arc<TcpStore>> = joined(4, "casc").into_iter().map(Arc::new).collect();
        let s3 = stores[3].clone();
        let late = thread::spawn(move || s3.report_unresponsive(&[0, 1]));
        thread::sleep(Duration::from_millis(50));
        stores[0].report_unresponsive(&[1]);
        late.join().expect("thread");
        let t0 = Instant::now();
        while stores[2].dead_peers().is_empty() && t0.elapsed() < Duration::from_secs(2) {
            thread::sleep(Duration::from_millis(1));
        }
        thread::sleep(Duration::from_millis(100));
        assert_eq!(stores[2].dead_peers(), vec![DeadPeer { rank: 1, reported_by: Some(0) }]);
        assert_eq!(stores[3].dead_peers(), vec![DeadPeer { rank: 1, reported_by: Some(0) }]);
    }

    /// Rank 0 times out on rank 2, which is itself waiting on stopped rank 1 and reports it a
    /// little later: rank 0's report returns only after rank 2's went out, so rank 0 already
    /// knows rank 1 is the one that stopped (and can name it rather than rank 2).
    #[test]
    fn a_report_returns_after_the_report_of_the_rank_it_names() {
        let stores: Vec<Arc<TcpStore>> = joined(3, "chain").into_iter().map(Arc::new).collect();
        let s0 = stores[0].clone();
        let first = thread::spawn(move || {
            s0.report_unresponsive(&[2]);
            s0.dead_peers()
        });
        thread::sleep(Duration::from_millis(150));
        stores[2].report_unresponsive(&[1]);
        let seen = first.join().expect("thread");
        assert_eq!(seen, vec![DeadPeer { rank: 1, reported_by: Some(2) }]);
        // Rank 2 was alive (it reported): never named.
        thread::sleep(Duration::from_millis(50));
        assert_eq!(stores[1].dead_peers(), vec![]);
    }

    #[test]
    fn a_fake_store_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let fake = thread::spawn(move || {
            let (s, _) = listener.accept().expect("accept");
            let by = deadline_in(5000);
            let _ = read_frame(&s, Some(by), HELLO_MAX_FRAME).ok().expect("hello");
            let challenge = frame(K_CHALLENGE, &[&PROTOCOL_VERSION.to_le_bytes(), &[5u8; 32]]);
            write_all_by(&s, &challenge, by).ok().expect("challenge");
            let _ = read_frame(&s, Some(by), HELLO_MAX_FRAME).ok().expect("proof");
            write_all_by(&s, &frame(K_WELCOME, &[&[0u8; 32]]), by).ok().expect("welcome");
            thread::sleep(Duration::from_millis(200));
        });
        match TcpStore::new(opts(port, 1, 2, "fake", 3000)) {
            Err(BootstrapError::Auth { detail, .. }) => {
                assert!(detail.contains("not this job's store"))
            }
            other => panic!("expected Auth, got {:?}", other.err()),
        }
        fake.join().expect("fake");
    }

    #[test]
    fn other_versions_are_refused_by_version() {
        let port = free_port();
        let _s0 = TcpStore::new(opts(port, 0, 2, "ver", 3000)).expect("rank 0");
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        // v1's hello: magic, version, rank, world, job id, and nothing after.
        let v1 = frame(
            K_HELLO,
            &[
                &MAGIC,
                &1u32.to_le_bytes(),
                &1u64.to_le_bytes(),
                &2u64.to_le_bytes(),
                &str_field("ver"),
            ],
        );
        write_all_by(&s, &v1, deadline_in(2000)).ok().expect("send");
        let (kind, payload) =
            read_frame(&s, Some(deadline_in(2000)), REPLY_MAX_FRAME).ok().expect("answer");
        assert_eq!(
            (kind, payload),
            (K_REFUSE, [&[REFUSE_VERSION][..], &PROTOCOL_VERSION.to_le_bytes()].concat())
        );
    }
}
