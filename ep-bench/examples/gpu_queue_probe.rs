//! Which streams of one CUDA context share a hardware work queue with a given stream?
//!
//! Ranks as threads of one process put spinning receive kernels on their own streams; a peer's
//! send queued behind such a kernel in the same hardware queue cannot start until the wait ends
//! (a false dependency, ll_notes.md). This probe measures it directly: a kernel on stream A
//! spins on mapped host memory; a kernel that returns at once is launched on stream S; if S's
//! work does not finish within `--window-ms` while A spins, S shares A's queue.
//!
//! Three layouts: `live` (A, then `--streams` streams created and all kept alive; each tested in
//! turn), `churn` (A, then streams created, tested and destroyed one after another, as
//! harnesses that make fresh streams per case do), and `blocked` (as `live`, but a stream W
//! created right after A waits for an event recorded on A behind the spin, so W's queue head is
//! a blocked wait rather than a running kernel, as an event join behind a spinning receive is).
//! Prints one `QUEUE_PROBE` line per layout with the 1-based creation index (after A, and W) of
//! every stream that was held.
//!
//! `gpu_queue_probe [--streams 40] [--window-ms 20]`; run it under different
//! `CUDA_DEVICE_MAX_CONNECTIONS` values.

use clap::Parser;
use fabric_ep::abi::fep_wait_test_params;
use fabric_ep::cuda::launch::wait_test;
use fabric_ep::cuda::{gpu_available, DevErrorRecord, Device, Event, HostMapped, Stream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Streams created after A in each layout.
    #[arg(long, default_value_t = 40)]
    streams: usize,
    /// How long S may take while A spins before it counts as held behind A.
    #[arg(long, default_value_t = 20)]
    window_ms: u64,
}

type R<T> = Result<T, Box<dyn std::error::Error>>;

struct Probe {
    a: Stream,
    flag: HostMapped,
    err: DevErrorRecord,
    window: Duration,
}

impl Probe {
    fn params(&self, expected: u64) -> fep_wait_test_params {
        fep_wait_test_params {
            counter: self.flag.device_ptr(),
            dev_error: self.err.as_abi(),
            expected,
            budget_cycles: 8_000_000_000, // ~4 s: the host releases A well before
            rank: 0,
            phase: 0,
            peer: 0,
            _pad: 0,
        }
    }

    /// True when `s`'s immediate kernel was held until A's spin ended. With `w`, W waits for an
    /// event recorded on A behind the spin and then runs an immediate kernel, before S's.
    fn held(&self, s: &Stream, w: Option<(&Stream, &Event)>) -> R<bool> {
        let c = self.flag.atomic_u64(0)?;
        c.store(0, Ordering::Release);
        // SAFETY: flag and err outlive both synchronisations below.
        unsafe { wait_test(&self.a, self.params(1))? };
        if let Some((w, ev)) = w {
            ev.record(&self.a)?;
            w.wait_event(ev)?;
            unsafe { wait_test(w, self.params(0))? };
        }
        // Let A's kernel start spinning before S's kernel is queued.
        std::thread::sleep(Duration::from_millis(2));
        unsafe { wait_test(s, self.params(0))? };
        let t = Instant::now();
        let mut done = false;
        while t.elapsed() < self.window {
            if s.query()? {
                done = true;
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        c.store(1, Ordering::Release);
        self.a.synchronize_within(Duration::from_secs(10))?;
        s.synchronize_within(Duration::from_secs(10))?;
        if let Some((w, _)) = w {
            w.synchronize_within(Duration::from_secs(10))?;
        }
        self.err.check()?;
        Ok(!done)
    }
}

fn main() -> R<()> {
    let a = Args::parse();
    if !gpu_available() {
        eprintln!("gpu_queue_probe: no GPU");
        std::process::exit(2);
    }
    let dev = Device::from_env()?;
    dev.bind()?;
    let conns = std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").unwrap_or_else(|_| "unset".into());
    let p = Probe {
        a: Stream::new(&dev)?,
        flag: HostMapped::new(&dev, 8)?,
        err: DevErrorRecord::new(&dev)?,
        window: Duration::from_millis(a.window_ms),
    };
    // Sanity: A itself is held (the probe can see a shared queue at all).
    let self_held = p.held(&p.a, None)?;
    let live: Vec<Stream> = (0..a.streams).map(|_| Stream::new(&dev)).collect::<Result<_, _>>()?;
    let mut held_live = Vec::new();
    for (i, s) in live.iter().enumerate() {
        if p.held(s, None)? {
            held_live.push(i + 1);
        }
    }
    drop(live);
    let mut held_churn = Vec::new();
    for i in 0..a.streams {
        let s = Stream::new(&dev)?;
        if p.held(&s, None)? {
            held_churn.push(i + 1);
        }
    }
    let w = Stream::new(&dev)?;
    let ev = Event::new_untimed(&dev)?;
    let live: Vec<Stream> = (0..a.streams).map(|_| Stream::new(&dev)).collect::<Result<_, _>>()?;
    let mut held_blocked = Vec::new();
    for (i, s) in live.iter().enumerate() {
        if p.held(s, Some((&w, &ev)))? {
            held_blocked.push(i + 1);
        }
    }
    println!(
        "QUEUE_PROBE connections={conns} layout=live streams={} held={held_live:?} self_held={self_held}",
        a.streams
    );
    println!(
        "QUEUE_PROBE connections={conns} layout=churn streams={} held={held_churn:?}",
        a.streams
    );
    println!(
        "QUEUE_PROBE connections={conns} layout=blocked streams={} held={held_blocked:?}",
        a.streams
    );
    Ok(())
}
