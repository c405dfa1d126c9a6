#!/usr/bin/env python3
"""The fault matrix: ep-bench jobs on the host backend (ranks as processes, one per "node") in
which one rank is killed (SIGKILL) or stopped (SIGSTOP) at a chosen moment, over every provider
and both modes. Each run passes when it ends within its bound (no hang) and every surviving
rank's error names the failed rank. Prints one line per run and a summary:

    python3 scripts/fault_matrix.py [--reps 3] [--bin target/release/ep-bench]

`--at` moments (seconds after the job starts) fall in connect, the first steps and the steady
run; the job's timeout is 4 s and it runs enough iterations to be mid-run at the last moment.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import time

PROVIDERS = ["shm", "tcp;ofi_rxm", "udp;ofi_rxd"]
MODES = ["normal", "low-latency"]
FAULTS = ["kill", "stop"]
VICTIM = 1
WORLD = 3


def rank_pids(launcher: int) -> dict:
    """RANK -> pid of the launcher's rank processes (read from their environments)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if b"RANK" in env:
                out[int(env[b"RANK"])] = int(pid)
        except (OSError, ValueError, IndexError):
            continue
    return out


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def names(section: str, peer: int) -> bool:
    pats = [rf"ranks \[[^\]]*\b{peer}\b", rf"rank {peer} has left", rf"to rank {peer}\b",
            rf"peer {peer}\b", rf"from rank {peer}\b", rf"rank {peer}\b.*(died|dead|left|closed|stopped responding)"]
    return any(re.search(p, section) for p in pats)


def one(binary: str, provider: str, mode: str, fault: str, at: float) -> tuple:
    args = [binary, "--backend", "host", "--mode", mode, "--provider", provider,
            "--ranks", str(WORLD), "--ranks-per-node", "1", "--tokens", "32", "--hidden", "256",
            "--topk", "2", "--experts", "6", "--iters", "100000", "--timeout", "4"]
    env = dict(os.environ, FEP_LOG="error")
    t0 = time.monotonic()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    pids = {}
    # The moment counts from the job's start, but never before every rank process exists: on a
    # loaded host the launcher may take longer than `at` to start them (then the fault comes as
    # soon as they do, still before or at the store).
    while (time.monotonic() - t0 < at or len(pids) < WORLD) and p.poll() is None:
        if time.monotonic() - t0 > at + 10:
            break
        time.sleep(0.02)
        pids.update(rank_pids(p.pid))
    pids.update(rank_pids(p.pid))
    if p.poll() is not None:
        out, err = p.communicate()
        return ("finished-before-fault", time.monotonic() - t0, err[-300:])
    if VICTIM not in pids or len(pids) < WORLD:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return ("no-victim", time.monotonic() - t0, "")
    os.kill(pids[VICTIM], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    faulted = time.monotonic()
    # The survivors must end by themselves (a stopped victim never does: it is killed once they
    # have, so the launcher can report).
    survivors = [pid for r, pid in pids.items() if r != VICTIM]
    while any(os.path.exists(f"/proc/{pid}") and not zombie(pid) for pid in survivors):
        if time.monotonic() - faulted > 60:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            return ("HANG", time.monotonic() - faulted, "a survivor still running after 60 s")
        time.sleep(0.02)
    took = time.monotonic() - faulted
    try:
        os.kill(pids[VICTIM], signal.SIGKILL)
    except OSError:
        pass
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return ("HANG", time.monotonic() - faulted, "the launcher did not end")
    bad = []
    for r in range(WORLD):
        if r == VICTIM:
            continue
        sec = err.split(f"--- rank {r} stderr ---")
        sec = sec[1].split("--- rank")[0] if len(sec) > 1 else ""
        if not names(sec, VICTIM):
            bad.append((r, sec.strip()[-800:]))
    if p.returncode == 0:
        return ("SUCCEEDED", took, "a job with a failed rank reported success")
    if bad:
        return ("UNNAMED", took, "; ".join(f"rank {r}: {s}" for r, s in bad))
    return ("ok", took, "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="target/release/ep-bench")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--at", default="0.4,1.2,2.5", help="fault moments, s (comma list)")
    ap.add_argument("--providers", default=",".join(PROVIDERS),
                    help="providers to run, comma list (to replay one case: --providers shm "
                         "--modes low-latency --faults kill --at 2.5 --reps 20)")
    ap.add_argument("--modes", default=",".join(MODES), help="modes to run, comma list")
    ap.add_argument("--faults", default=",".join(FAULTS), help="kill and/or stop, comma list")
    a = ap.parse_args()
    moments = [float(x) for x in a.at.split(",")]
    providers, modes, faults = (x.split(",") for x in (a.providers, a.modes, a.faults))
    for what, got, known in [("--providers", providers, PROVIDERS), ("--modes", modes, MODES),
                             ("--faults", faults, FAULTS)]:
        unknown = [x for x in got if x not in known]
        if unknown:
            ap.error(f"{what}: unknown {unknown}; known: {known}")
    tally = {}
    n = 0
    t_all = time.monotonic()
    for rep in range(a.reps):
        for prov in providers:
            for mode in modes:
                for fault in faults:
                    for at in moments:
                        v, took, why = one(a.bin, prov, mode, fault, at)
                        n += 1
                        tally[v] = tally.get(v, 0) + 1
                        print(f"{prov:<12} {mode:<11} {fault:<4} at {at:>4.1f} s: {v} "
                              f"({took:.2f} s after the fault){' ' + why if why else ''}",
                              flush=True)
    print(f"fault matrix: {n} runs in {time.monotonic() - t_all:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    bad = sum(v for k, v in tally.items() if k in ("HANG", "UNNAMED", "SUCCEEDED", "no-victim"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
