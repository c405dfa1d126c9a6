//! A local launcher: N ranks of one executable as OS processes, with the env vars torchrun sets, so
//! `ep-bench --ranks N` and the multi-process tests exercise exactly the path a cluster job takes.

use std::fmt;
use std::fs::{self, File};
use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use super::auth::random_bytes;
use super::{later, node_local_world};
use crate::util::SplitMix64;

/// How long reaping a child we just sent SIGKILL may take before we stop waiting for it.
const REAP_AFTER_KILL: Duration = Duration::from_secs(5);

/// What one rank did.
#[derive(Debug)]
pub struct RankOutcome {
    pub rank: usize,
    /// `None` if the process could not be reaped even after SIGKILL (see `timed_out`).
    pub status: Option<ExitStatus>,
    /// Still running at the deadline of [`LocalJob::wait`], and killed.
    pub timed_out: bool,
    /// Killed on purpose through [`LocalJob::kill_rank`].
    pub killed: bool,
    pub stdout: String,
    pub stderr: String,
}

impl RankOutcome {
    /// Exited by itself with status 0.
    pub fn success(&self) -> bool {
        !self.timed_out && self.status.is_some_and(|s| s.success())
    }
}

impl fmt::Display for RankOutcome {
    /// The rank, how it ended and its captured output: what a failing test or `ep-bench` prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = match (self.timed_out, self.killed, self.status) {
            (true, _, _) => "timed out (killed at the deadline)".to_string(),
            (_, true, _) => "killed on request".to_string(),
            (_, _, Some(s)) => s.to_string(),
            (_, _, None) => "not reaped".to_string(),
        };
        writeln!(f, "rank {}: {how}", self.rank)?;
        for (name, text) in [("stdout", &self.stdout), ("stderr", &self.stderr)] {
            if !text.trim().is_empty() {
                writeln!(f, "--- rank {} {name} ---\n{}", self.rank, text.trim_end())?;
            }
        }
        Ok(())
    }
}

/// N ranks running as local processes. Dropping it kills whatever is still running.
pub struct LocalJob {
    children: Vec<Option<Child>>,
    statuses: Vec<Option<ExitStatus>>,
    timed_out: Vec<bool>,
    killed: Vec<bool>,
    dir: PathBuf,
    port: u16,
    job_id: String,
}

impl LocalJob {
    /// Starts `world_size` processes of `exe args...` with `MASTER_ADDR=127.0.0.1`, a free
    /// `MASTER_PORT` (also as `FEP_MASTER_PORT`, so an inherited override cannot redirect them),
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK = rank % local_world_size`, `LOCAL_WORLD_SIZE`,
    /// `GROUP_RANK` (the node), a unique `FEP_JOB_ID` and a random `FEP_JOB_SECRET` (so that no
    /// other process on the machine can join the job's store), plus `extra_env`. Each rank's stdout
    /// and stderr go to files read back by [`wait`](Self::wait).
    pub fn spawn(
        exe: &Path,
        args: &[String],
        world_size: usize,
        local_world_size: usize,
        extra_env: &[(String, String)],
    ) -> io::Result<LocalJob> {
        Self::spawn_with(exe, args, world_size, local_world_size, extra_env, &|_| Vec::new())
    }

    /// [`spawn`](Self::spawn) with per-rank env vars on top (applied last, so they may override the
    /// launcher's own: failure tests give one rank a wrong `WORLD_SIZE` or `FEP_JOB_SECRET`; an
    /// empty value counts as unset for the store).
    pub fn spawn_with(
        exe: &Path,
        args: &[String],
        world_size: usize,
        local_world_size: usize,
        extra_env: &[(String, String)],
        rank_env: &dyn Fn(usize) -> Vec<(String, String)>,
    ) -> io::Result<LocalJob> {
        if world_size == 0 || local_world_size == 0 || local_world_size > world_size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "LocalJob: world_size {world_size} and local_world_size {local_world_size}: \
                     need 1 <= local_world_size <= world_size"
                ),
            ));
        }
        let port = free_port()?;
        let job_id = unique_job_id();
        let secret: String = random_bytes::<16>()?.iter().map(|b| format!("{b:02x}")).collect();
        let dir = std::env::temp_dir().join(&job_id);
        fs::create_dir_all(&dir)?;
        let mut job = LocalJob {
            children: Vec::with_capacity(world_size),
            statuses: vec![None; world_size],
            timed_out: vec![false; world_size],
            killed: vec![false; world_size],
            dir,
            port,
            job_id,
        };
        for rank in 0..world_size {
            let stdout = File::create(job.stdout_path(rank))?;
            let stderr = File::create(job.stderr_path(rank))?;
            let mut cmd = Command::new(exe);
            cmd.args(args)
                .stdin(Stdio::null())
                .stdout(stdout)
                .stderr(stderr)
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("FEP_MASTER_PORT", port.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world_size.to_string())
                .env("LOCAL_RANK", (rank % local_world_size).to_string())
                .env(
                    "LOCAL_WORLD_SIZE",
                    node_local_world(rank, world_size, local_world_size).to_string(),
                )
                .env("GROUP_RANK", (rank / local_world_size).to_string())
                .env("FEP_JOB_ID", &job.job_id)
                .env("FEP_JOB_SECRET", &secret);
            for (k, v) in extra_env.iter().cloned().chain(rank_env(rank)) {
                cmd.env(k, v);
            }
            // On failure `job` drops here and kills the ranks already started.
            let child = cmd.spawn().map_err(|e| {
                io::Error::new(e.kind(), format!("spawn rank {rank} ({}): {e}", exe.display()))
            })?;
            job.children.push(Some(child));
        }
        Ok(job)
    }

    /// The store port the ranks were given.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The job id the ranks were given.
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    pub fn world_size(&self) -> usize {
        self.statuses.len()
    }

    /// Where rank `rank`'s stdout goes (readable while it runs: tests poll it for progress).
    pub fn stdout_path(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("rank-{rank}.out"))
    }

    /// Where rank `rank`'s stderr goes.
    pub fn stderr_path(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("rank-{rank}.err"))
    }

    /// Sends SIGKILL to rank `rank` (failure tests: a peer dying mid-run).
    pub fn kill_rank(&mut self, rank: usize) -> io::Result<()> {
        let Some(slot) = self.children.get_mut(rank) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("kill_rank({rank}): the job has {} ranks", self.statuses.len()),
            ));
        };
        if let Some(child) = slot {
            child.kill()?;
            self.killed[rank] = true;
        }
        Ok(())
    }

    /// Waits until every rank exits or `timeout` passes, then kills the rest; returns one outcome
    /// per rank, in rank order, with its captured output.
    pub fn wait(&mut self, timeout: Duration) -> io::Result<Vec<RankOutcome>> {
        let deadline = later(Instant::now(), timeout);
        let mut pause = Duration::from_millis(1);
        loop {
            self.reap()?;
            if self.children.iter().all(Option::is_none) {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                for (rank, slot) in self.children.iter_mut().enumerate() {
                    if let Some(child) = slot {
                        self.timed_out[rank] = true;
                        let _ = child.kill();
                    }
                }
                self.reap_killed();
                break;
            }
            // Polling with a growing pause (capped at 20 ms): std offers no wait-with-timeout on
            // a child, and a thread per child would outlive a child that cannot be reaped.
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(20));
        }
        let read = |p: PathBuf| fs::read(p).map(|b| String::from_utf8_lossy(&b).into_owned());
        (0..self.statuses.len())
            .map(|rank| {
                Ok(RankOutcome {
                    rank,
                    status: self.statuses[rank],
                    timed_out: self.timed_out[rank],
                    killed: self.killed[rank],
                    stdout: read(self.stdout_path(rank))?,
                    stderr: read(self.stderr_path(rank))?,
                })
            })
            .collect()
    }

    fn reap(&mut self) -> io::Result<()> {
        for (rank, slot) in self.children.iter_mut().enumerate() {
            if let Some(child) = slot {
                if let Some(status) = child.try_wait()? {
                    self.statuses[rank] = Some(status);
                    *slot = None;
                }
            }
        }
        Ok(())
    }

    /// Reaps children already sent SIGKILL, giving up after `REAP_AFTER_KILL` (a process stuck
    /// in the kernel cannot be waited for forever).
    fn reap_killed(&mut self) {
        let until = later(Instant::now(), REAP_AFTER_KILL);
        while self.children.iter().any(Option::is_some) && Instant::now() < until {
            if self.reap().is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for LocalJob {
    fn drop(&mut self) {
        for child in self.children.iter_mut().flatten() {
            let _ = child.kill();
        }
        self.reap_killed();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A port nothing listens on right now, for rank 0's store.
///
/// NOTES: "bind port 0, read it, close" hands out a port from the kernel's ephemeral range, which
/// the kernel may give to any outgoing connection (other ranks', other tests') before rank 0 binds
/// it. So pick at random *below* that range, check it binds, and never hand out the same port
/// twice in one process; fall back to port 0 only if that fails. Another process could still take
/// the port before rank 0 binds; rank 0 then fails naming it.
pub(crate) fn free_port() -> io::Result<u16> {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse::<u16>().ok()))
        .unwrap_or(32768);
    let floor: u16 = 10_000;
    if low > floor + 1000 {
        let seed = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let mut rng = SplitMix64(seed as u64 ^ ((std::process::id() as u64) << 32));
        let mut given = GIVEN.lock();
        for _ in 0..64 {
            let port = floor + rng.below(u64::from(low - floor)) as u16;
            if !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.push(port);
                return Ok(port);
            }
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn unique_job_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("fep-local-{}-{:x}-{n}", std::process::id(), nanos & 0xffff_ffff_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_and_captures_a_shell_per_rank() {
        let args = vec!["-c".to_string(), "echo r=$RANK/$WORLD_SIZE l=$LOCAL_RANK/$LOCAL_WORLD_SIZE g=$GROUP_RANK x=$X s=${#FEP_JOB_SECRET}; exit $RANK".to_string()];
        let mut job =
            LocalJob::spawn(Path::new("/bin/sh"), &args, 3, 2, &[("X".into(), "y".into())])
                .expect("spawn");
        let out = job.wait(Duration::from_secs(10)).expect("wait");
        assert_eq!(out[0].stdout.trim(), "r=0/3 l=0/2 g=0 x=y s=32");
        assert_eq!(out[2].stdout.trim(), "r=2/3 l=0/1 g=1 x=y s=32");
        assert!(out[0].success());
        assert_eq!(out[1].status.and_then(|s| s.code()), Some(1));
    }

    #[test]
    fn free_ports_are_distinct_and_bindable() {
        let ports: Vec<u16> = (0..20).map(|_| free_port().expect("port")).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len());
        for p in ports {
            TcpListener::bind(("127.0.0.1", p)).expect("bindable");
        }
    }

    #[test]
    fn kills_at_the_deadline_and_on_request() {
        let args = vec!["-c".to_string(), "sleep 30".to_string()];
        let mut job = LocalJob::spawn(Path::new("/bin/sh"), &args, 2, 2, &[]).expect("spawn");
        job.kill_rank(1).expect("kill");
        let start = Instant::now();
        let out = job.wait(Duration::from_millis(200)).expect("wait");
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(out[0].timed_out && !out[0].success());
        assert!(out[1].killed && !out[1].timed_out);
        assert!(job.kill_rank(2).is_err());
    }
}
