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
    /// `count` writes posted from `ring` completed locally (their send data is reusable).
    SendDone { ring: u32, count: u32 },
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
}
