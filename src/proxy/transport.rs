//! What a proxy worker posts writes to.

use super::ProxyError;

/// One RMA write with immediate data, as read from a ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteOp {
    pub dst_rank: u32,
    /// Bytes into this rank's send region.
    pub local_offset: u64,
    /// Bytes into `dst_rank`'s receive region.
    pub remote_offset: u64,
    pub length: u32,
    pub imm: u32,
    /// The ring the command came from: its local completion is credited to
    /// `sends_completed[ring]`.
    pub ring: u32,
}

/// What [`Transport::poll`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportEvent {
    /// `count` writes posted from `ring` to rank `dst` completed locally (their send data is
    /// reusable).
    SendDone { ring: u32, dst: u32, count: u32 },
    /// A write into this rank's receive region arrived, with its immediate and length.
    Arrival { imm: u32, len: u32 },
}

/// A transport moves bytes from this rank's send region into a peer's receive region and reports
/// arrivals. Implementations bounds-check offsets against the regions they own, so posting is safe;
/// keeping send data unchanged until `SendDone` is the producer's protocol (`sends_completed`).
pub trait Transport: Send + 'static {
    /// Called once on the worker thread before the worker reports ready; an error here is the
    /// start error `Proxy::start` returns.
    fn on_start(&mut self) -> Result<(), ProxyError> {
        Ok(())
    }

    /// Posts one write. `Ok(false)`: backpressured (EAGAIN): the caller polls, then retries the
    /// same op; it is never dropped. `Err`: the transport or a peer failed (typed, naming it).
    fn post_write(&mut self, op: &WriteOp) -> Result<bool, ProxyError>;

    /// Appends completions and arrivals to `events` (does not clear it) and makes progress.
    fn poll(&mut self, events: &mut Vec<TransportEvent>) -> Result<(), ProxyError>;

    /// The stopping worker's news that a rank died: writes in flight may never complete, so
    /// dropping the transport need not wait for them. Default: nothing to do.
    fn abandon_in_flight(&mut self) {}
}

/// Two transports behind one: writes to the peers `near[dst]` marks go to `near_t` (this
/// node's ranks over an intranode provider), the others to `far_t` (the network); `poll` drains
/// both. Used by the host backend's `BufferOptions::intranode_provider`, so the direct path's
/// intranode traffic takes the node's own link as it would on GPUs (NVLink), not the NIC.
#[derive(Debug)]
pub struct SplitTransport<A, B> {
    pub near: Vec<bool>,
    pub near_t: A,
    pub far_t: B,
}

impl<A: Transport, B: Transport> Transport for SplitTransport<A, B> {
    fn on_start(&mut self) -> Result<(), ProxyError> {
        self.near_t.on_start()?;
        self.far_t.on_start()
    }

    fn post_write(&mut self, op: &WriteOp) -> Result<bool, ProxyError> {
        if self.near.get(op.dst_rank as usize).copied().unwrap_or(false) {
            self.near_t.post_write(op)
        } else {
            self.far_t.post_write(op)
        }
    }

    fn poll(&mut self, events: &mut Vec<TransportEvent>) -> Result<(), ProxyError> {
        self.near_t.poll(events)?;
        self.far_t.poll(events)
    }

    fn abandon_in_flight(&mut self) {
        self.near_t.abandon_in_flight();
        self.far_t.abandon_in_flight();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the destinations it is asked to write to; reports one arrival per poll.
    #[derive(Default)]
    struct Log {
        posted: Vec<u32>,
        imm: u32,
    }

    impl Transport for Log {
        fn post_write(&mut self, op: &WriteOp) -> Result<bool, ProxyError> {
            self.posted.push(op.dst_rank);
            Ok(true)
        }
        fn poll(&mut self, events: &mut Vec<TransportEvent>) -> Result<(), ProxyError> {
            events.push(TransportEvent::Arrival { imm: self.imm, len: 0 });
            Ok(())
        }
    }

    #[test]
    fn throttle_holds_far_writes_to_the_rate_and_passes_near_ones() {
        let mut t = Throttled::new(Log::default(), vec![false, true], Some(1e6)); // 1 MB/s
        let far = WriteOp { dst_rank: 1, length: 100_000, ..WriteOp::default() };
        let near = WriteOp { dst_rank: 0, length: 100_000, ..WriteOp::default() };
        let t0 = std::time::Instant::now();
        let mut sent = 0u64;
        while t0.elapsed() < std::time::Duration::from_millis(200) {
            if t.post_write(&far).unwrap() {
                sent += 100_000;
            }
            assert!(t.post_write(&near).unwrap(), "near writes are never held");
        }
        // At most the rate times the time taken, plus one write of debt and 1 ms of credit (a
        // bound that holds however the thread is scheduled); at least the first write.
        let bound = (t0.elapsed().as_secs_f64() * 1e6) as u64 + 100_000 + 1_000;
        assert!(sent >= 100_000 && sent <= bound, "{sent} bytes, bound {bound}");
        let mut free = Throttled::new(Log::default(), vec![true], None);
        for _ in 0..1000 {
            assert!(free.post_write(&WriteOp { length: 1 << 20, ..WriteOp::default() }).unwrap());
        }
    }

    #[test]
    fn split_routes_by_peer_and_polls_both() {
        let mut t = SplitTransport {
            near: vec![true, true, false, false],
            near_t: Log { imm: 1, ..Log::default() },
            far_t: Log { imm: 2, ..Log::default() },
        };
        for d in [0, 2, 1, 3, 3, 7] {
            assert!(t.post_write(&WriteOp { dst_rank: d, ..WriteOp::default() }).unwrap());
        }
        assert_eq!(t.near_t.posted, vec![0, 1]);
        assert_eq!(t.far_t.posted, vec![2, 3, 3, 7], "unknown peers go to the network");
        let mut ev = Vec::new();
        t.poll(&mut ev).unwrap();
        assert_eq!(
            ev,
            vec![
                TransportEvent::Arrival { imm: 1, len: 0 },
                TransportEvent::Arrival { imm: 2, len: 0 }
            ]
        );
    }
}

/// A bench aid: caps the rate of the writes to the peers `far` marks at `bytes_per_s` (a token
/// bucket that may go into debt by one write, so any write size passes at the average rate),
/// to stand in for a network slower than the node's own link on a machine where both are
/// memory copies (`BufferOptions::emulate_network_gbps`). A write over the rate is
/// backpressured (`Ok(false)`, as EAGAIN), so nothing is dropped. `bytes_per_s = None`: no cap.
#[derive(Debug)]
pub struct Throttled<T> {
    inner: T,
    far: Vec<bool>,
    bytes_per_s: Option<f64>,
    credit: f64,
    last: std::time::Instant,
}

impl<T> Throttled<T> {
    pub fn new(inner: T, far: Vec<bool>, bytes_per_s: Option<f64>) -> Self {
        Throttled { inner, far, bytes_per_s, credit: 0.0, last: std::time::Instant::now() }
    }
}

impl<T: Transport> Transport for Throttled<T> {
    fn on_start(&mut self) -> Result<(), ProxyError> {
        self.last = std::time::Instant::now();
        self.inner.on_start()
    }

    fn post_write(&mut self, op: &WriteOp) -> Result<bool, ProxyError> {
        let Some(rate) = self.bytes_per_s else { return self.inner.post_write(op) };
        if !self.far.get(op.dst_rank as usize).copied().unwrap_or(true) {
            return self.inner.post_write(op);
        }
        let now = std::time::Instant::now();
        // At most 1 ms of idle credit: the cap holds over any window longer than that.
        let burst = rate * 1e-3;
        self.credit = (self.credit + now.duration_since(self.last).as_secs_f64() * rate).min(burst);
        self.last = now;
        if self.credit < 0.0 {
            return Ok(false);
        }
        let posted = self.inner.post_write(op)?;
        if posted {
            self.credit -= f64::from(op.length);
        }
        Ok(posted)
    }

    fn poll(&mut self, events: &mut Vec<TransportEvent>) -> Result<(), ProxyError> {
        self.inner.poll(events)
    }

    fn abandon_in_flight(&mut self) {
        self.inner.abandon_in_flight();
    }
}
