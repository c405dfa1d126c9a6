//! Diagnostics through `tracing`, on stderr, one line per decision, prefixed with the rank:
//!
//! ```text
//! fabric-ep[rank 3] INFO fabric: rank 3 lane 0/4: domain rdmap16s27-rdm ...
//! ```
//!
//! `FEP_LOG` sets the filter (`warn`, `info`, `debug`, `trace`, `off`, `error`, or
//! `target=level` directives such as `warn,fabric_ep::fabric=debug`); without it `RUST_LOG` is
//! honoured; the default is `warn`. The subscriber is installed on the first event this crate
//! emits ([`ensure`]), once: when the host application already installed a global subscriber,
//! events go through theirs instead (nothing fails).
//!
//! The rank is known after the bootstrap: [`set_rank`] records it for the calling thread (ranks
//! may be threads of one process) and for the process (the threads this crate spawns).
//! Info is for set-up decisions; nothing on a per-call path logs above debug.

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Once;

use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

static INIT: Once = Once::new();
static PROCESS_RANK: AtomicI64 = AtomicI64::new(-1);
thread_local! {
    static THREAD_RANK: Cell<i64> = const { Cell::new(-1) };
}

/// The variable this module reads first.
pub const LOG_VAR: &str = "FEP_LOG";
const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// Records `rank` for this thread's lines and, as the fallback, for the process's.
pub fn set_rank(rank: usize) {
    ensure();
    let r = rank as i64;
    THREAD_RANK.with(|c| c.set(r));
    PROCESS_RANK.store(r, Ordering::Relaxed);
}

/// The rank the calling thread's lines carry (`None` before the bootstrap).
pub fn rank() -> Option<usize> {
    let t = THREAD_RANK.with(|c| c.get());
    let r = if t >= 0 { t } else { PROCESS_RANK.load(Ordering::Relaxed) };
    (r >= 0).then_some(r as usize)
}

/// The filter from `FEP_LOG`'s value (`fep`) or else `RUST_LOG`'s (`rust`), with a complaint
/// when the value was refused (then the default, `warn`, applies).
pub fn filter_spec(fep: Option<&str>, rust: Option<&str>) -> (String, Option<String>) {
    if let Some(v) = fep.map(str::trim) {
        return match check_fep(v) {
            Ok(s) => (s, None),
            Err(e) => ("warn".into(), Some(e)),
        };
    }
    if let Some(v) = rust.map(str::trim).filter(|v| !v.is_empty()) {
        return match EnvFilter::try_new(v) {
            Ok(_) => (v.to_string(), None),
            Err(e) => ("warn".into(), Some(format!("RUST_LOG={v:?} refused ({e}); using warn"))),
        };
    }
    ("warn".into(), None)
}

/// `FEP_LOG`: comma-separated directives, each a level or `target=level`.
fn check_fep(v: &str) -> Result<String, String> {
    let refuse = |what: String| {
        Err(format!(
            "{LOG_VAR}={v:?}: {what}; expected a level ({}) or target=level directives; \
             using warn",
            LEVELS.join(", ")
        ))
    };
    if v.is_empty() {
        return refuse("empty".into());
    }
    for d in v.split(',').map(str::trim) {
        let level = match d.rsplit_once('=') {
            Some((target, level)) if !target.is_empty() => level,
            _ => d,
        };
        if !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(level)) {
            return refuse(format!("{d:?} is not a level"));
        }
    }
    match EnvFilter::try_new(v) {
        Ok(_) => Ok(v.to_ascii_lowercase()),
        Err(e) => refuse(e.to_string()),
    }
}

/// Installs the subscriber on first use (idempotent, cheap after the first call).
pub fn ensure() {
    INIT.call_once(|| {
        let (spec, complaint) = filter_spec(
            std::env::var(LOG_VAR).ok().as_deref(),
            std::env::var("RUST_LOG").ok().as_deref(),
        );
        let filter = EnvFilter::try_new(&spec).unwrap_or_else(|_| EnvFilter::new("warn"));
        let sub = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .event_format(RankFormat)
            .with_env_filter(filter)
            .finish();
        // Another global subscriber (the host application's) wins: ours is dropped and the
        // events reach theirs.
        let _ = tracing::subscriber::set_global_default(sub);
        if let Some(c) = complaint {
            tracing::warn!(target: "fabric_ep::log", "{c}");
        }
    });
}

/// `fabric-ep[rank N] LEVEL target: message fields`.
struct RankFormat;

impl<S, N> FormatEvent<S, N> for RankFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        match rank() {
            Some(r) => write!(w, "fabric-ep[rank {r}] ")?,
            None => write!(w, "fabric-ep[pid {}] ", std::process::id())?,
        }
        let target = meta.target();
        let target = target.strip_prefix("fabric_ep::").unwrap_or(target);
        write!(w, "{} {target}: ", meta.level())?;
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// `tracing::info!` after [`ensure`].
#[macro_export]
#[doc(hidden)]
macro_rules! fep_info {
    ($($t:tt)*) => {{ $crate::log::ensure(); ::tracing::info!($($t)*) }};
}

/// `tracing::warn!` after [`ensure`].
#[macro_export]
#[doc(hidden)]
macro_rules! fep_warn {
    ($($t:tt)*) => {{ $crate::log::ensure(); ::tracing::warn!($($t)*) }};
}

/// `tracing::debug!` after [`ensure`].
#[macro_export]
#[doc(hidden)]
macro_rules! fep_debug {
    ($($t:tt)*) => {{ $crate::log::ensure(); ::tracing::debug!($($t)*) }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fep_log_levels_and_directives() {
        assert_eq!(filter_spec(Some("info"), Some("trace")), ("info".into(), None));
        assert_eq!(filter_spec(Some("DEBUG"), None), ("debug".into(), None));
        assert_eq!(
            filter_spec(Some("warn,fabric_ep::fabric=trace"), None),
            ("warn,fabric_ep::fabric=trace".into(), None)
        );
        assert_eq!(filter_spec(None, None), ("warn".into(), None));
        assert_eq!(filter_spec(None, Some("debug")), ("debug".into(), None));
        assert_eq!(filter_spec(None, Some("  ")), ("warn".into(), None));
    }

    #[test]
    fn bad_fep_log_names_the_variable_and_falls_back() {
        for bad in ["verbose", "", "fabric_ep=loud", "info,chatty"] {
            let (spec, complaint) = filter_spec(Some(bad), None);
            assert_eq!(spec, "warn", "{bad:?}");
            let c = complaint.unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(c.starts_with("FEP_LOG="), "{c}");
        }
    }

    #[test]
    fn rank_is_per_thread_with_a_process_fallback() {
        std::thread::spawn(|| {
            set_rank(7);
            assert_eq!(rank(), Some(7));
            std::thread::spawn(|| {
                // A thread that never set one sees the process's latest.
                assert!(rank().is_some());
                set_rank(2);
                assert_eq!(rank(), Some(2));
            })
            .join()
            .unwrap();
            assert_eq!(rank(), Some(7));
        })
        .join()
        .unwrap();
    }
}
