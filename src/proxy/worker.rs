//! The proxy: worker threads that drain rings into a transport and publish counters, plus the
//! bounded host-side waits on those counters.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::memory::{CounterMemory, RingConsumer, RingMemory};
use super::transport::{Transport, TransportEvent, WriteOp};
use super::ProxyError;
use crate::abi;
use crate::protocol::plan::ImmCodec;
use crate::trace::host_event;
use crate::util::Backoff;

/// How long a worker failure that names no peer waits for the bootstrap's news of a rank that
/// left ([`Proxy::blame_dead_peer`]).
const BLAME_WAIT: Duration = Duration::from_secs(2);

/// How a host-side wait backs off: spins, then yields, then sleeps 1/64 of the time it has
/// waited so far (20 us to 1 ms). The added latency stays under 2% of the wait, and a wait of
/// seconds (a slow provider, a peer that is late) wakes about a thousand times a second instead
/// of tens of thousands: on a host with more busy threads than cores those wake-ups took the CPU
/// from the proxy threads whose progress the wait is for.
struct WaitBackoff {
    inner: Backoff,
    rounds: u32,
    start: Instant,
}

impl WaitBackoff {
    const SPINS: u32 = 128;
    const YIELDS: u32 = 4096;

    fn new() -> Self {
        WaitBackoff {
            inner: Backoff::new(Self::SPINS, Self::YIELDS),
            rounds: 0,
            start: Instant::now(),
        }
    }

    fn snooze(&mut self) {
        if self.rounds < Self::YIELDS {
            self.rounds += 1;
            self.inner.snooze();
        } else {
            let s = self.start.elapsed() / 64;
            std::thread::sleep(s.clamp(Duration::from_micros(20), Duration::from_millis(1)));
        }
    }
}

/// Settings for [`Proxy::start`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyConfig {
    /// This process's global rank (names errors and threads).
    pub rank: u32,
    /// Low bits of the immediate that carry the value; the rest name the counter slot.
    pub value_bits: u32,
    /// Most commands read from one ring per pass (before polling the transport again).
    pub batch: u32,
    /// Idle policy: after this long without work the worker stops spinning and yields.
    pub idle_spin: Duration,
    /// After this long without work (counted from the last work) it sleeps between passes.
    pub idle_yield: Duration,
    /// Sleep per idle pass in the sleeping regime: the wake-up latency a long-idle worker adds
    /// (benches/proxy.rs measures it).
    pub idle_sleep: Duration,
    /// The sleep grows with the idle stretch (1/64 of it) up to this: a worker idle for long
    /// wakes less often (each wake is a CQ poll, a syscall on most providers, which on a host
    /// with more busy threads than cores takes the CPU from the threads doing the work), at a
    /// wake-up latency of at most 1/64 of the time it was idle. Equal to `idle_sleep`: a fixed
    /// sleep.
    pub idle_sleep_max: Duration,
    /// How long `start` waits for each worker's ready handshake.
    pub start_timeout: Duration,
    /// On shutdown, how long a worker keeps polling for completions of writes it posted.
    pub drain_timeout: Duration,
    /// How rings are shared among several workers. `false`: ring `r` belongs to worker
    /// `r % workers` alone. `true`: every worker drains every ring, worker `i` posting the
    /// tickets `t` with `t % workers == i` ([`RingMemory`]'s striped consumers), so the writes of
    /// one ring go out on all workers' endpoints at once.
    pub stripe_rings: bool,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            rank: 0,
            value_bits: ImmCodec::DEFAULT_VALUE_BITS,
            batch: 256,
            idle_spin: Duration::from_micros(100),
            idle_yield: Duration::from_millis(2),
            idle_sleep: Duration::from_micros(20),
            idle_sleep_max: Duration::from_micros(20),
            start_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(1),
            stripe_rings: false,
        }
    }
}

impl ProxyConfig {
    fn validate(&self) -> Result<ImmCodec, ProxyError> {
        if self.batch == 0 {
            return Err(ProxyError::InvalidConfig { what: "batch", msg: "must be >= 1".into() });
        }
        Ok(ImmCodec::new(self.value_bits)?)
    }
}

/// One expected arrival count, for [`Proxy::wait_all`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArrivalWait {
    pub slot: u32,
    pub expected: u64,
    /// The rank that writes into this slot (named when the wait times out).
    pub peer: u32,
}

/// A slot still short when a wait timed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lagging {
    pub peer: u32,
    pub slot: u32,
    pub expected: u64,
    pub observed: u64,
}

impl std::fmt::Display for Lagging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.peer == u32::MAX {
            write!(f, "slot {}: {}/{}", self.slot, self.observed, self.expected)
        } else {
            write!(
                f,
                "peer {} (slot {}): {}/{}",
                self.peer, self.slot, self.observed, self.expected
            )
        }
    }
}

/// The thread name of rank `rank`'s worker `i` (also the `worker` of its errors).
pub(crate) fn worker_name(rank: u32, i: usize) -> String {
    format!("fep-proxy-{rank}-{i}")
}

/// The rank in a [`worker_name`], if `name` is one.
pub(crate) fn worker_rank(name: &str) -> Option<u32> {
    name.strip_prefix("fep-proxy-")?.split('-').next()?.parse().ok()
}

/// "peer 2 (slot 2): 12/24, ..." for error messages.
pub(crate) fn lagging_list(lagging: &[Lagging]) -> String {
    lagging.iter().map(Lagging::to_string).collect::<Vec<_>>().join(", ")
}

struct Shared {
    stop: AtomicBool,
    failed: AtomicBool,
    error: Mutex<Option<(String, Arc<ProxyError>)>>,
    /// Bumped by a waiter that wants every worker's writes in flight (a timed-out
    /// `wait_sends`); each worker answers once per bump into `owed`.
    owed_request: AtomicU64,
    owed: Mutex<OwedReport>,
    /// Ranks known dead (the bootstrap's news: [`Proxy::watch_peers`]), asked by every wait
    /// and by a stopping worker (writes to a dead rank never complete).
    peer_watch: std::sync::OnceLock<PeerWatch>,
}

/// Workers' answers to one `owed_request`: writes posted and not completed, per (ring, rank).
#[derive(Default)]
struct OwedReport {
    request: u64,
    replies: usize,
    inflight: Vec<(u32, u32, u64)>,
}

impl Shared {
    fn record(&self, worker: &str, err: ProxyError) {
        let mut slot = self.error.lock();
        if slot.is_none() {
            *slot = Some((worker.to_string(), Arc::new(err)));
        }
        self.failed.store(true, Ordering::Release);
        // NOTES: one failed worker stops them all: the rank cannot keep its protocol promises.
        self.stop.store(true, Ordering::Release);
    }
}

struct WorkerHandle {
    name: String,
    thread: Option<JoinHandle<()>>,
}

/// Proxy worker threads for one rank. Ring `r` is served by worker `r % transports.len()`.
/// Dropping it stops and joins the workers (same path as [`Proxy::shutdown`]).
pub struct Proxy {
    rank: u32,
    codec: ImmCodec,
    rings: RingMemory,
    counters: CounterMemory,
    shared: Arc<Shared>,
    workers: Vec<WorkerHandle>,
}

/// Tells which ranks are known dead (first reported first; empty: none). Asked on every pass of a wait, so
/// it must be cheap when nobody died (the TCP store's and in-process groups' answer is one
/// atomic load then).
pub type PeerWatch = Arc<dyn Fn() -> Vec<crate::bootstrap::DeadPeer> + Send + Sync>;

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("rank", &self.rank)
            .field("workers", &self.workers.iter().map(|w| &w.name).collect::<Vec<_>>())
            .finish()
    }
}

impl Proxy {
    /// Starts one worker per transport, each named `fep-proxy-<rank>-<i>`, and returns once every
    /// worker is ready (or with the first start error; workers already started are stopped).
    pub fn start<T: Transport>(
        config: ProxyConfig,
        rings: RingMemory,
        counters: CounterMemory,
        transports: Vec<T>,
    ) -> Result<Self, ProxyError> {
        let codec = config.validate()?;
        if transports.is_empty() {
            return Err(ProxyError::InvalidConfig {
                what: "transports",
                msg: "need at least one (one per worker)".into(),
            });
        }
        let num_rings = rings.layout().num_rings;
        if counters.layout().num_rings != num_rings {
            return Err(ProxyError::InvalidConfig {
                what: "counters.num_rings",
                msg: format!(
                    "{} sends_completed counters for {} rings",
                    counters.layout().num_rings,
                    num_rings
                ),
            });
        }
        let num_workers = transports.len();
        crate::fep_info!(
            "proxy: rank {} starts {num_workers} worker(s) over {num_rings} ring(s){}, batch {}, \
             start timeout {:?}, drain timeout {:?}",
            config.rank,
            if config.stripe_rings { " (striped)" } else { "" },
            config.batch,
            config.start_timeout,
            config.drain_timeout
        );
        let mut proxy = Proxy {
            rank: config.rank,
            codec,
            rings: rings.clone(),
            counters: counters.clone(),
            shared: Arc::new(Shared {
                stop: AtomicBool::new(false),
                failed: AtomicBool::new(false),
                error: Mutex::new(None),
                owed_request: AtomicU64::new(0),
                owed: Mutex::new(OwedReport::default()),
                peer_watch: std::sync::OnceLock::new(),
            }),
            workers: Vec::with_capacity(num_workers),
        };
        // Claims happen here, on the caller's thread, so a claim error is a start error.
        let mut consumers: Vec<Vec<_>> = (0..num_workers).map(|_| Vec::new()).collect();
        for r in 0..num_rings {
            if config.stripe_rings {
                let stripes = rings.striped_consumers(r, num_workers as u32)?;
                for (w, c) in stripes.into_iter().enumerate() {
                    consumers[w].push(c);
                }
            } else {
                consumers[r as usize % num_workers].push(rings.consumer(r)?);
            }
        }
        for (i, (transport, consumers)) in transports.into_iter().zip(consumers).enumerate() {
            let name = worker_name(config.rank, i);
            let worker = Worker {
                name: name.clone(),
                rank: config.rank,
                codec,
                batch: u64::from(config.batch),
                idle_spin: config.idle_spin,
                idle_yield: config.idle_yield,
                idle_sleep: config.idle_sleep,
                idle_sleep_max: config.idle_sleep_max.max(config.idle_sleep),
                drain_timeout: config.drain_timeout,
                num_slots: counters.layout().num_slots,
                num_rings,
                counters: counters.clone(),
                consumers,
                transport,
                shared: proxy.shared.clone(),
                events: Vec::with_capacity(1024),
                posted: 0,
                completed: 0,
                inflight: vec![Vec::new(); num_rings as usize],
                answered: 0,
            };
            let (ready_tx, ready_rx) = mpsc::sync_channel(1);
            let thread = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || worker.run(ready_tx))
                .map_err(|source| ProxyError::Spawn { worker: name.clone(), source })?;
            proxy.workers.push(WorkerHandle { name: name.clone(), thread: Some(thread) });
            match ready_rx.recv_timeout(config.start_timeout) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    // NOTES: detach, do not join: the worker may be stuck in on_start for good.
                    // When on_start returns it finds the stop flag (set by Drop) and exits.
                    if let Some(w) = proxy.workers.last_mut() {
                        w.thread.take();
                    }
                    return Err(ProxyError::StartTimeout {
                        worker: name,
                        waited: config.start_timeout,
                    });
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(ProxyError::WorkerPanicked { worker: name })
                }
            }
        }
        Ok(proxy)
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn rings(&self) -> &RingMemory {
        &self.rings
    }

    pub fn counters(&self) -> &CounterMemory {
        &self.counters
    }

    /// The immediate split this proxy decodes.
    pub fn codec(&self) -> ImmCodec {
        self.codec
    }

    /// The first error a worker stopped on, if any.
    pub fn error(&self) -> Option<Arc<ProxyError>> {
        self.shared.error.lock().as_ref().map(|(_, e)| e.clone())
    }

    /// `Err(WorkerFailed)` once a worker has stopped on an error.
    pub fn check(&self) -> Result<(), ProxyError> {
        if !self.shared.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        match self.shared.error.lock().as_ref() {
            Some((worker, e)) => {
                Err(ProxyError::WorkerFailed { worker: worker.clone(), source: e.clone() })
            }
            None => Err(ProxyError::WorkerStopped { rank: self.rank }),
        }
    }

    /// The waited slots' arrival counters summed (wrapping): any change is progress.
    fn arrivals_seen(&self, waits: &[ArrivalWait]) -> u64 {
        waits.iter().fold(0u64, |acc, w| {
            acc.wrapping_add(self.counters.arrivals_atomic(w.slot).load(Ordering::Acquire))
        })
    }

    /// A worker's failure that names no peer (a target-side completion error: this libfabric's
    /// error entries carry no source address) is usually a peer's death that the fabric saw
    /// before the bootstrap: wait up to [`BLAME_WAIT`] for the bootstrap's report, and then name
    /// the rank that left instead.
    ///
    /// NOTES: a killed process's memory goes before its sockets close (the kernel unmaps it
    /// first): a peer writing into it (shm's cross-memory copies) fails at once, while the
    /// bootstrap hears of it only when the unmapping of a large buffer is done, hundreds of
    /// milliseconds later on a busy host. The fault matrix saw 250 ms run out.
    fn blame_dead_peer(&self, e: ProxyError) -> ProxyError {
        let Some(w) = self.shared.peer_watch.get() else { return e };
        let unnamed = |e: &ProxyError| matches!(e, ProxyError::Fabric { peer: None, .. });
        let names_none = match &e {
            ProxyError::WorkerFailed { source, .. } => unnamed(source),
            e => unnamed(e),
        };
        if !names_none {
            return e;
        }
        let start = Instant::now();
        while start.elapsed() < BLAME_WAIT {
            if let Some(d) = w().first() {
                return ProxyError::PeerDead {
                    rank: self.rank,
                    peer: d.rank as u32,
                    waiting: Vec::new(),
                    reported_by: d.reported_by.map(|b| b as u32),
                };
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        e
    }

    /// Lets every wait of this proxy end at once, naming the rank, when `watch` reports a dead
    /// rank (the bootstrap store sees a rank's connection close within milliseconds; without
    /// this a wait on it would last its whole timeout). Set once; later calls are ignored.
    pub fn watch_peers(&self, watch: PeerWatch) {
        let _ = self.shared.peer_watch.set(watch);
    }

    /// A worker's error, a stop, or a rank the bootstrap saw die (see [`Self::watch_peers`]).
    pub fn check_running(&self) -> Result<(), ProxyError> {
        if let Err(e) = self.check() {
            return Err(self.blame_dead_peer(e));
        }
        if let Some(w) = self.shared.peer_watch.get() {
            if let Some(d) = w().first() {
                return Err(ProxyError::PeerDead {
                    rank: self.rank,
                    peer: d.rank as u32,
                    waiting: Vec::new(),
                    reported_by: d.reported_by.map(|b| b as u32),
                });
            }
        }
        if self.shared.stop.load(Ordering::Acquire) {
            // NOTES: a failing worker records its error, then sets `failed`, then `stop`
            // (release stores); a waiter that read `failed` unset before the failure and `stop`
            // set after it must look again, or it reports "stopped" instead of the cause.
            self.check()?;
            return Err(ProxyError::WorkerStopped { rank: self.rank });
        }
        Ok(())
    }

    /// Waits (bounded) until `arrivals[slot] >= expected`; returns `sums[slot]`. The error names
    /// the slot (use [`Proxy::wait_all`] to name peers), or the worker error that stopped progress.
    pub fn wait_arrivals(
        &self,
        slot: u32,
        expected: u64,
        timeout: Duration,
    ) -> Result<u64, ProxyError> {
        self.wait_all(&[ArrivalWait { slot, expected, peer: u32::MAX }], timeout)?;
        self.counters.sums(slot)
    }

    /// Waits (bounded) until every `arrivals[w.slot] >= w.expected`. On timeout the error lists
    /// every slot still short with its peer.
    pub fn wait_all(&self, waits: &[ArrivalWait], timeout: Duration) -> Result<(), ProxyError> {
        for w in waits {
            self.counters.arrivals(w.slot)?;
        }
        // NOTES (deadline): `timeout` bounds the time without progress (an arrival), not the
        // whole wait: slow but live peers on a busy machine never time out, a silent one does.
        let mut idle_since = Instant::now();
        let mut backoff = WaitBackoff::new();
        let mut first_pending = 0;
        let mut seen = self.arrivals_seen(waits);
        let mut passes = 0u32;
        loop {
            while first_pending < waits.len() {
                let w = &waits[first_pending];
                if self.counters.arrivals_atomic(w.slot).load(Ordering::Acquire) < w.expected {
                    break;
                }
                first_pending += 1;
            }
            if first_pending == waits.len() {
                return Ok(());
            }
            if let Err(e) = self.check_running() {
                return Err(match e {
                    ProxyError::PeerDead { rank, peer, reported_by, .. } => {
                        let mut waiting: Vec<u32> = waits
                            .iter()
                            .filter(|w| {
                                self.counters.arrivals_atomic(w.slot).load(Ordering::Acquire)
                                    < w.expected
                            })
                            .map(|w| w.peer)
                            .filter(|&p| p != u32::MAX)
                            .collect();
                        waiting.sort_unstable();
                        waiting.dedup();
                        ProxyError::PeerDead { rank, peer, waiting, reported_by }
                    }
                    e => e,
                });
            }
            passes = passes.wrapping_add(1);
            if passes % 64 == 0 || idle_since.elapsed() >= timeout {
                // Any arrival on a waited slot, also past the first pending one, is progress.
                let now = self.arrivals_seen(waits);
                if now != seen {
                    (seen, idle_since) = (now, Instant::now());
                }
            }
            if idle_since.elapsed() >= timeout {
                let lagging = waits
                    .iter()
                    .filter_map(|w| {
                        let observed =
                            self.counters.arrivals_atomic(w.slot).load(Ordering::Acquire);
                        (observed < w.expected).then_some(Lagging {
                            peer: w.peer,
                            slot: w.slot,
                            expected: w.expected,
                            observed,
                        })
                    })
                    .collect();
                return Err(ProxyError::ArrivalTimeout {
                    rank: self.rank,
                    waited: idle_since.elapsed(),
                    lagging,
                });
            }
            backoff.snooze();
        }
    }

    /// Waits (bounded) until `sends_completed[ring] >= expected` (the ring's send data is reusable).
    pub fn wait_sends(
        &self,
        ring: u32,
        expected: u64,
        timeout: Duration,
    ) -> Result<(), ProxyError> {
        self.counters.sends_completed(ring)?;
        // As in `wait_all`: `timeout` bounds the time without a send completing.
        let mut idle_since = Instant::now();
        let mut backoff = WaitBackoff::new();
        let mut last = self.counters.sends_atomic(ring).load(Ordering::Acquire);
        loop {
            let observed = self.counters.sends_atomic(ring).load(Ordering::Acquire);
            if observed >= expected {
                return Ok(());
            }
            self.check_running()?;
            if observed != last {
                (last, idle_since) = (observed, Instant::now());
            }
            if idle_since.elapsed() >= timeout {
                let waited = idle_since.elapsed();
                return Err(ProxyError::SendTimeout {
                    rank: self.rank,
                    ring,
                    expected,
                    observed,
                    waited,
                    owed: self.inflight_of(ring),
                    queued: self.rings.queued_destinations(ring).unwrap_or_default(),
                });
            }
            backoff.snooze();
        }
    }

    /// The writes of `ring` posted and not completed, per destination rank: asks every worker
    /// (each answers on its next pass) and waits at most 200 ms for the answers; a worker that
    /// does not answer (stopped, or stuck in a provider call) is left out.
    fn inflight_of(&self, ring: u32) -> Vec<(u32, u64)> {
        {
            let mut r = self.shared.owed.lock();
            let id = self.shared.owed_request.load(Ordering::Acquire) + 1;
            *r = OwedReport { request: id, replies: 0, inflight: Vec::new() };
            self.shared.owed_request.store(id, Ordering::Release);
        }
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(200)
            && !self.shared.stop.load(Ordering::Acquire)
            && self.shared.owed.lock().replies < self.workers.len()
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        let r = self.shared.owed.lock();
        let mut per: Vec<(u32, u64)> = Vec::new();
        for &(_, dst, n) in r.inflight.iter().filter(|(g, _, _)| *g == ring) {
            match per.iter_mut().find(|(d, _)| *d == dst) {
                Some((_, m)) => *m += n,
                None => per.push((dst, n)),
            }
        }
        per.sort_unstable();
        per
    }

    /// Stops and joins the workers; returns the error a worker stopped on, if any.
    pub fn shutdown(mut self) -> Result<(), ProxyError> {
        self.stop_and_join();
        self.check()
    }

    fn stop_and_join(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                if t.join().is_err() {
                    self.shared
                        .record(&w.name, ProxyError::WorkerPanicked { worker: w.name.clone() });
                }
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

#[derive(Clone, Copy)]
enum Idle {
    Spin,
    Yield,
    Sleep,
}

struct Worker<T> {
    name: String,
    rank: u32,
    codec: ImmCodec,
    batch: u64,
    idle_spin: Duration,
    idle_yield: Duration,
    idle_sleep: Duration,
    idle_sleep_max: Duration,
    drain_timeout: Duration,
    num_slots: u32,
    num_rings: u32,
    counters: CounterMemory,
    consumers: Vec<RingConsumer>,
    transport: T,
    shared: Arc<Shared>,
    events: Vec<TransportEvent>,
    /// Writes posted / completed by this worker (for the shutdown drain).
    posted: u64,
    completed: u64,
    /// `inflight[ring][dst]`: writes posted and not completed (what a timeout says is owed).
    inflight: Vec<Vec<u64>>,
    /// The last `owed_request` answered.
    answered: u64,
}

impl<T: Transport> Worker<T> {
    fn run(mut self, ready: mpsc::SyncSender<Result<(), ProxyError>>) {
        // The sleeping idle regime wakes after idle_sleep + the timer slack (50 us by default on
        // Linux, which tripled the wake-up latency); 1 us of slack for this thread only.
        #[cfg(target_os = "linux")]
        // SAFETY: PR_SET_TIMERSLACK takes a plain integer and affects the calling thread only.
        unsafe {
            libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong);
        }
        if let Err(e) = self.transport.on_start() {
            // The receiver is gone only if `start` already gave up; nothing else to tell.
            let _ = ready.send(Err(e));
            return;
        }
        if ready.send(Ok(())).is_err() {
            return;
        }
        if let Err(e) = self.main_loop() {
            self.shared.record(&self.name, e);
        }
        // Best effort after an error (it is already recorded): writes that were posted still
        // complete, so the counters say what really went out.
        let _ = self.drain();
        // Once a rank is known dead, writes in flight may never complete: those to it, and
        // (on providers that progress an endpoint's operations in order, as shm may) those
        // queued behind them. The transport need not wait for them when it is dropped; it keeps
        // its send registration instead (a bounded leak, on a job that is failing anyway).
        if !self.dead_ranks().is_empty() {
            self.transport.abandon_in_flight();
        }
    }

    /// Ranks the bootstrap reports dead (none without a watch).
    fn dead_ranks(&self) -> Vec<usize> {
        self.shared
            .peer_watch
            .get()
            .map(|w| w().iter().map(|d| d.rank).collect())
            .unwrap_or_default()
    }

    /// Bounded: polls until every write this worker posted has completed, or a rank is known
    /// dead (see `run`), or `drain_timeout`.
    fn drain(&mut self) -> Result<(), ProxyError> {
        let start = Instant::now();
        let mut passes = 0u32;
        while self.completed < self.posted && start.elapsed() < self.drain_timeout {
            if self.poll_transport()? == 0 {
                std::thread::yield_now();
            }
            passes = passes.wrapping_add(1);
            if passes % 64 == 0 && !self.dead_ranks().is_empty() {
                break;
            }
        }
        Ok(())
    }

    fn main_loop(&mut self) -> Result<(), ProxyError> {
        // Idle passes in a row, and when the idle stretch began (read once every 64 passes,
        // so an idle worker does not hammer the clock).
        let mut idle = 0u32;
        let mut idle_since = Instant::now();
        let mut regime = Idle::Spin;
        while !self.shared.stop.load(Ordering::Relaxed) {
            if self.shared.owed_request.load(Ordering::Relaxed) != self.answered {
                self.answer_owed();
            }
            let mut work = self.poll_transport()?;
            let mut backpressured = false;
            // NOTES: a back-pressured ring (its head command refused with EAGAIN, e.g. to a
            // peer that stopped answering) keeps its command and is retried next pass; the
            // other rings still drain, so one stalled peer does not stall the rest.
            for i in 0..self.consumers.len() {
                let (n, full) = self.drain_ring(i)?;
                work += n;
                backpressured |= full;
            }
            if work > 0 || backpressured {
                idle = 0;
                regime = Idle::Spin;
                continue;
            }
            if idle == 0 {
                idle_since = Instant::now();
            }
            idle = idle.wrapping_add(1);
            if idle % 64 == 0 {
                let t = idle_since.elapsed();
                regime = if t < self.idle_spin {
                    Idle::Spin
                } else if t < self.idle_yield {
                    Idle::Yield
                } else {
                    Idle::Sleep
                };
            }
            match regime {
                Idle::Spin => std::hint::spin_loop(),
                Idle::Yield => std::thread::yield_now(),
                Idle::Sleep => std::thread::sleep(
                    (idle_since.elapsed() / 64).clamp(self.idle_sleep, self.idle_sleep_max),
                ),
            }
        }
        Ok(())
    }

    /// Adds this worker's writes in flight to the report a waiter asked for.
    #[cold]
    fn answer_owed(&mut self) {
        let mut r = self.shared.owed.lock();
        self.answered = self.shared.owed_request.load(Ordering::Acquire);
        if r.request != self.answered {
            return;
        }
        for (ring, per) in self.inflight.iter().enumerate() {
            for (dst, &n) in per.iter().enumerate() {
                if n > 0 {
                    r.inflight.push((ring as u32, dst as u32, n));
                }
            }
        }
        r.replies += 1;
    }

    /// Polls the transport and publishes what it reported. Returns the number of events.
    /// A bad event is reported after the whole batch is published (the good ones still count).
    #[inline]
    fn poll_transport(&mut self) -> Result<u64, ProxyError> {
        self.events.clear();
        self.transport.poll(&mut self.events)?;
        let mut failed = None;
        for ev in &self.events {
            match *ev {
                TransportEvent::Arrival { imm, .. } => {
                    let (slot, value) = self.codec.decode(imm);
                    host_event(abi::FEP_TRACE_PROXY_ARRIVAL, self.rank, slot);
                    if slot < self.num_slots {
                        self.counters.record_arrival(slot, value);
                    } else if failed.is_none() {
                        failed = Some(ProxyError::BadSlot {
                            rank: self.rank,
                            imm,
                            slot,
                            num_slots: self.num_slots,
                        });
                    }
                }
                TransportEvent::SendDone { ring, dst, count } => {
                    host_event(abi::FEP_TRACE_PROXY_SEND_DONE, self.rank, count);
                    if ring < self.num_rings {
                        self.counters.record_sends(ring, count);
                        self.completed += u64::from(count);
                        if let Some(n) = self.inflight[ring as usize].get_mut(dst as usize) {
                            *n = n.saturating_sub(u64::from(count));
                        }
                    } else if failed.is_none() {
                        failed = Some(ProxyError::BadCompletion {
                            rank: self.rank,
                            ring,
                            num_rings: self.num_rings,
                        });
                    }
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(self.events.len() as u64),
        }
    }

    /// Posts up to `batch` commands from consumer `i`. Returns (commands posted, backpressured).
    #[inline]
    fn drain_ring(&mut self, i: usize) -> Result<(u64, bool), ProxyError> {
        let c = &mut self.consumers[i];
        let mut avail = c.pending();
        if avail == Some(0) {
            avail = c.refresh();
            match avail {
                Some(0) => return Ok((0, false)),
                Some(n) => host_event(abi::FEP_TRACE_PROXY_RING_SEEN, self.rank, n as u32),
                None => {}
            }
        }
        let Some(avail) = avail else {
            return Err(ProxyError::BadHead {
                rank: self.rank,
                ring: c.ring,
                head: c.cached_head,
                tail: c.tail,
                capacity: c.capacity,
            });
        };
        let n = avail.min(self.batch);
        let mut posted = 0u64;
        let mut full = false;
        let mut failed = None;
        for _ in 0..n {
            let e = c.entry();
            if e.seq != c.tail as u32 {
                failed = Some(ProxyError::BadSeq {
                    rank: self.rank,
                    ring: c.ring,
                    ticket: c.tail,
                    expected: c.tail as u32,
                    found: e.seq,
                });
                break;
            }
            let op = WriteOp {
                dst_rank: e.dst_rank,
                local_offset: e.local_offset,
                remote_offset: e.remote_offset,
                length: e.length,
                imm: e.imm,
                ring: c.ring,
            };
            match self.transport.post_write(&op) {
                Ok(true) => {
                    c.advance();
                    posted += 1;
                    // `ring < num_rings` (a claimed consumer's); `dst` a rank the transport
                    // accepted, so the table grows to the world at most.
                    let per = &mut self.inflight[op.ring as usize];
                    if per.len() <= op.dst_rank as usize {
                        per.resize(op.dst_rank as usize + 1, 0);
                    }
                    per[op.dst_rank as usize] += 1;
                }
                Ok(false) => {
                    full = true;
                    break;
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if posted > 0 {
            // NOTES: tail is published after posting, once per batch: an entry stays in the ring
            // until the transport has accepted it, so EAGAIN needs no side queue (the refused entry
            // is simply read again) and the ring, not the proxy, absorbs backpressure: a stalled
            // transport makes producers wait instead of growing memory here.
            c.publish_tail();
            self.posted += posted;
            host_event(abi::FEP_TRACE_PROXY_POSTED, self.rank, posted as u32);
        }
        match failed {
            Some(e) => Err(e),
            None => Ok((posted, full)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::memory::{Command, CounterLayout, RingLayout};

    /// Writes to rank 1 are taken and never complete; to rank 3 they complete at once; rank 2
    /// backpressures for ever (EAGAIN).
    struct Stuck {
        done: Vec<TransportEvent>,
    }

    impl Transport for Stuck {
        fn post_write(&mut self, op: &WriteOp) -> Result<bool, ProxyError> {
            match op.dst_rank {
                2 => Ok(false),
                3 => {
                    self.done.push(TransportEvent::SendDone { ring: op.ring, dst: 3, count: 1 });
                    Ok(true)
                }
                _ => Ok(true),
            }
        }
        fn poll(&mut self, events: &mut Vec<TransportEvent>) -> Result<(), ProxyError> {
            events.append(&mut self.done);
            Ok(())
        }
    }

    /// Fails its first poll with a target-side completion error (no peer named).
    struct TargetSideError;

    impl Transport for TargetSideError {
        fn post_write(&mut self, _: &WriteOp) -> Result<bool, ProxyError> {
            Ok(true)
        }
        fn poll(&mut self, _: &mut Vec<TransportEvent>) -> Result<(), ProxyError> {
            Err(ProxyError::Fabric {
                rank: 0,
                peer: None,
                source: crate::fabric::FabricError::Completion {
                    err: 5,
                    prov_errno: -5,
                    text: "Input/output error".into(),
                    op_context: 0,
                    len: 0,
                    flags: 0,
                },
            })
        }
    }

    #[test]
    fn a_failure_naming_no_peer_names_the_rank_the_bootstrap_reports_late() {
        let rings = RingMemory::new_host(RingLayout::new(1, 16).unwrap()).unwrap();
        let counters =
            CounterMemory::new_host(CounterLayout { num_slots: 4, num_rings: 1 }).unwrap();
        let proxy =
            Proxy::start(ProxyConfig::default(), rings, counters, vec![TargetSideError]).unwrap();
        // The bootstrap hears of rank 2's death 600 ms after the fabric failed.
        let t = Instant::now();
        proxy.watch_peers(Arc::new(move || {
            if t.elapsed() > Duration::from_millis(600) {
                vec![crate::bootstrap::DeadPeer { rank: 2, reported_by: None }]
            } else {
                Vec::new()
            }
        }));
        let waits = [ArrivalWait { slot: 1, expected: 1, peer: 2 }];
        match proxy.wait_all(&waits, Duration::from_secs(10)) {
            Err(ProxyError::PeerDead { peer: 2, waiting, .. }) => assert_eq!(waiting, vec![2]),
            other => panic!("expected rank 2 named, got {other:?}"),
        }
        assert!(t.elapsed() < BLAME_WAIT + Duration::from_secs(1), "{:?}", t.elapsed());
    }

    #[test]
    fn a_send_timeout_says_which_peers_are_owed_what() {
        let rings = RingMemory::new_host(RingLayout::new(1, 16).unwrap()).unwrap();
        let counters =
            CounterMemory::new_host(CounterLayout { num_slots: 4, num_rings: 1 }).unwrap();
        let proxy = Proxy::start(
            ProxyConfig { rank: 5, ..ProxyConfig::default() },
            rings.clone(),
            counters,
            vec![Stuck { done: Vec::new() }],
        )
        .unwrap();
        let mut p = rings.producer(0).unwrap();
        for dst in [1, 3, 1, 2, 3, 2, 2] {
            let cmd =
                Command { dst_rank: dst, local_offset: 0, remote_offset: 0, length: 8, imm: 0 };
            assert!(p.try_push(&cmd));
        }
        let err = proxy.wait_sends(0, 7, Duration::from_millis(300)).unwrap_err();
        match &err {
            ProxyError::SendTimeout {
                rank: 5,
                ring: 0,
                expected: 7,
                observed: 1,
                owed,
                queued,
                ..
            } => {
                assert_eq!(owed, &vec![(1, 2)], "{err}");
                // The first write to rank 2 holds the ring: it and everything behind it wait.
                assert_eq!(queued, &vec![(2, 3), (3, 1)], "{err}");
            }
            other => panic!("expected a send timeout, got {other}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("waiting for 2 sends to rank 1 (posted, not completed)"), "{msg}");
        assert!(msg.contains("waiting for 3 sends to rank 2, 1 to rank 3 (queued)"), "{msg}");
    }
}
