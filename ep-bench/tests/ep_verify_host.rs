//! Regression cases the randomized matrix (`ep-bench verify`, `ep_bench::verify`) found on the host
//! backend, each the smallest case that showed the fault, run through the matrix's own runner
//! (ranks as threads, every output against the reference), plus the matrix's command line:
//! its replay line, its last line and its exit status.

use std::time::Duration;

use ep_bench::verify::{
    draw_case, host_rank, run_case_threads, CallKind, CallSpec, CaseOutcome, CaseSpec, Launch,
    LlCall, Mode, NormalCall, Routing, ShapeSpec, VerifyBackend, VerifyOptions,
};

mod common;
use common::ep_bench;

fn opts() -> VerifyOptions {
    VerifyOptions {
        backend: VerifyBackend::Host,
        cases: 1,
        seed: 0,
        case: None,
        repeat: 1,
        launch: Launch::Threads,
        timeout: Duration::from_secs(20),
        verbose: false,
        jobs: 1,
        exe: env!("CARGO_BIN_EXE_ep-bench").into(),
    }
}

fn normal_call(tokens: Vec<usize>, routing: Routing, n: NormalCall) -> CallSpec {
    CallSpec { tokens, routing, mask: 0.0, seed: 11, kind: CallKind::Normal(n) }
}

fn plain() -> NormalCall {
    NormalCall {
        alignment: 1,
        worst_extra: None,
        weights: true,
        pass_layout: false,
        cached: None,
        repeat: 1,
    }
}

fn shape(
    hidden: usize,
    topk: usize,
    experts: usize,
    hier: bool,
    calls: Vec<CallSpec>,
) -> ShapeSpec {
    ShapeSpec {
        hidden,
        topk,
        experts,
        fp8: false,
        chunk_tokens: Some(16),
        slots_per_peer: Some(2),
        max_tokens: 8,
        hier,
        calls,
    }
}

fn case(mode: Mode, ranks: usize, rpn: usize, shapes: Vec<ShapeSpec>) -> CaseSpec {
    CaseSpec {
        index: 0,
        seed: 0,
        backend: VerifyBackend::Host,
        mode,
        procs: false,
        provider: "shm",
        intranode: None,
        num_ranks: ranks,
        ranks_per_node: rpn,
        mr_max_bytes: None,
        ring_capacity: None,
        emulate_gbps: None,
        shapes,
    }
}

fn assert_ok(spec: &CaseSpec) {
    match run_case_threads(&opts(), spec, host_rank) {
        CaseOutcome::Ok { combines, .. } => assert!(combines > 0, "nothing combined"),
        other => panic!("{}: {other:?}", spec.describe()),
    }
}

/// Seed 3, case 16 and others, reduced: the hierarchy's cached dispatch given `topk_idx` returned
/// no `recv_topk_idx` / `recv_topk_weights` (the direct path returns them), because its node
/// stage was never passed the rail stage's top-k on a cached call.
#[test]
fn hierarchy_cached_dispatch_with_topk_returns_it() {
    let n = NormalCall { cached: Some(true), ..plain() };
    let spec = case(
        Mode::Normal,
        2,
        1,
        vec![shape(128, 2, 8, true, vec![normal_call(vec![3, 2], Routing::Uniform, n)])],
    );
    assert_ok(&spec);
}

/// Seed 3, case 96, reduced: with `num_worst_tokens`, a rank of the hierarchy that receives no
/// row returned an empty `recv_topk_idx` instead of its padding rows' -1 (the rows were
/// permuted by a helper that read "no rows" as "no top-k").
#[test]
fn hierarchy_rank_receiving_nothing_pads_its_topk() {
    let n = NormalCall { worst_extra: Some(1), ..plain() };
    let spec = case(
        Mode::Normal,
        2,
        1,
        vec![shape(128, 2, 8, true, vec![normal_call(vec![2, 1], Routing::Starve(1), n)])],
    );
    assert_ok(&spec);
    // Every rank without tokens at all, too.
    let n = NormalCall { worst_extra: Some(1), cached: Some(true), ..plain() };
    let spec = case(
        Mode::Normal,
        2,
        1,
        vec![shape(128, 2, 8, true, vec![normal_call(vec![0, 0], Routing::Uniform, n)])],
    );
    assert_ok(&spec);
}

/// The direct path's same calls (the reference for the two above).
#[test]
fn direct_path_cached_topk_and_empty_ranks() {
    let calls = vec![
        normal_call(vec![3, 2], Routing::Uniform, NormalCall { cached: Some(true), ..plain() }),
        normal_call(vec![2, 1], Routing::Starve(1), NormalCall { worst_extra: Some(1), ..plain() }),
        normal_call(
            vec![0, 0],
            Routing::Uniform,
            NormalCall { worst_extra: Some(2), cached: Some(false), ..plain() },
        ),
    ];
    assert_ok(&case(Mode::Normal, 2, 1, vec![shape(128, 2, 8, false, calls)]));
}

/// Seed 3, case 44: a hierarchy whose top-k exceeds one node's experts is refused at
/// construction, with an error that names the limit (it named the node stage's own range).
#[test]
fn hierarchy_refuses_topk_beyond_a_nodes_experts_by_name() {
    let spec = case(
        Mode::Normal,
        2,
        1,
        vec![shape(128, 6, 8, true, vec![normal_call(vec![1, 1], Routing::Uniform, plain())])],
    );
    match run_case_threads(&opts(), &spec, host_rank) {
        CaseOutcome::Mismatch(m) => {
            assert!(m.contains("num_topk") && m.contains("node stage"), "{m}");
        }
        other => panic!("accepted: {other:?}"),
    }
}

/// Low latency: two dispatches before a combine, both hooked and overlapped, a second combine
/// on the same handle, a clean between calls, zero tokens on a rank: DeepEP's test sequence.
#[test]
fn low_latency_sequence_of_deepeps_test() {
    let ll = |double: bool, hook: bool, clean: bool| LlCall {
        fp8: hook,
        round_scale: false,
        hook_dispatch: hook,
        hook_combine: hook,
        double,
        overlap: double && hook,
        combine_mask: clean,
        clean_before: clean,
        combine_twice: true,
        repeat: 3,
    };
    let calls =
        [(false, false, false), (true, true, false), (true, false, true), (false, true, true)]
            .iter()
            .enumerate()
            .map(|(i, &(d, h, c))| CallSpec {
                tokens: vec![8, if i % 2 == 0 { 0 } else { 8 }, 5],
                routing: Routing::Uniform,
                mask: 0.1,
                seed: 40 + i as u64,
                kind: CallKind::Ll(ll(d, h, c)),
            })
            .collect();
    let mut sh = shape(256, 3, 12, false, calls);
    sh.max_tokens = 8;
    assert_ok(&case(Mode::LowLatency, 3, 3, vec![sh]));
}

/// The draw covers what the matrix promises (over the first 300 cases of seed 1): both modes
/// and every provider, splits, processes, every hidden class, skewed routings, masks, fp8,
/// alignment, num_worst_tokens, cached handles, hooks.
#[test]
fn the_draw_covers_the_matrix() {
    let cases: Vec<CaseSpec> =
        (0..300).map(|i| draw_case(1, i, VerifyBackend::Host, Launch::Auto)).collect();
    let any = |f: &dyn Fn(&CaseSpec) -> bool| cases.iter().any(f);
    let calls = || cases.iter().flat_map(|c| c.shapes.iter().flat_map(|s| s.calls.iter()));
    for p in ep_bench::verify::PROVIDERS {
        for m in [Mode::Normal, Mode::LowLatency] {
            let n = cases.iter().filter(|c| c.provider == p && c.mode == m).count();
            assert!(n >= 40, "{p} {m:?}: {n} cases");
            assert!(any(&|c| c.provider == p && c.mode == m && c.split()), "{p} {m:?} split");
            assert!(any(&|c| c.provider == p && c.mode == m && c.procs), "{p} {m:?} procs");
        }
    }
    for h in [128, 2560, 5120, 6144, 7168, 8192] {
        assert!(any(&|c| c.shapes.iter().any(|s| s.hidden == h)), "hidden {h}");
    }
    assert!(calls().any(|c| matches!(c.routing, Routing::OneExpert(_))));
    assert!(calls().any(|c| matches!(c.routing, Routing::Starve(_))));
    assert!(calls().any(|c| matches!(c.routing, Routing::Hot { .. })));
    assert!(calls().any(|c| c.mask > 0.4));
    assert!(calls().any(|c| c.tokens.contains(&0) && c.tokens.iter().any(|&t| t > 100)));
    let normal = || {
        calls().filter_map(|c| match &c.kind {
            CallKind::Normal(n) => Some(n.clone()),
            _ => None,
        })
    };
    for a in [1, 4, 128] {
        assert!(normal().any(|n| n.alignment == a), "alignment {a}");
    }
    assert!(normal().any(|n| n.worst_extra.is_some()));
    assert!(normal().any(|n| n.cached == Some(true)) && normal().any(|n| n.cached == Some(false)));
    assert!(normal().any(|n| !n.weights));
    let ll = || {
        calls().filter_map(|c| match &c.kind {
            CallKind::Ll(l) => Some(l.clone()),
            _ => None,
        })
    };
    assert!(ll().any(|l| l.hook_dispatch) && ll().any(|l| !l.hook_dispatch));
    assert!(ll().any(|l| l.overlap) && ll().any(|l| l.fp8) && ll().any(|l| l.clean_before));
    assert!(any(&|c| c.shapes.iter().any(|s| s.fp8)));
    assert!(any(&|c| c.shapes.iter().any(|s| s.hier)));
    assert!(any(&|c| c.shapes.len() > 1));
    let topk_max = cases.iter().flat_map(|c| c.shapes.iter().map(|s| s.topk)).max().unwrap();
    assert!(topk_max > 9, "top-k up to {topk_max}");
    // The GPU backend's draw (ranks as processes) reaches its hierarchy and forced nodes too.
    let gpu: Vec<CaseSpec> =
        (0..300).map(|i| draw_case(1, i, VerifyBackend::Gpu, Launch::Procs)).collect();
    let hier = gpu.iter().filter(|c| c.shapes.iter().any(|s| s.hier)).count();
    let split = gpu.iter().filter(|c| c.split()).count();
    assert!(hier >= 15 && split > hier, "GPU: {hier} hierarchy cases, {split} split");
}

/// `ep-bench verify --case I` replays one case (its description first, ranks as processes
/// when it draws them), and the last line is the summary; a case the engine refuses is a
/// mismatch with its replay command and a failing exit status.
#[test]
fn verify_command_replays_one_case_and_summarises() {
    // The first case of seed 1 that runs its ranks as processes.
    let i = (0..100)
        .find(|&i| {
            let c = draw_case(1, i, VerifyBackend::Host, Launch::Auto);
            c.procs && c.shapes.len() == 1
        })
        .expect("a case with processes");
    let out = ep_bench()
        .args(["verify", "--backend", "host", "--seed", "1", "--case", &i.to_string()])
        .output()
        .expect("run ep-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with(&format!("case {i}: ")), "{stdout}");
    assert!(stdout.contains("as processes"), "{stdout}");
    assert_eq!(stdout.lines().last(), Some("verify: 1 cases, 0 mismatches, 0 hangs"), "{stdout}");
    // --repeat runs it again in the same process.
    let out = ep_bench()
        .args(["verify", "--backend", "host", "--seed", "1", "--cases", "2", "--repeat", "2"])
        .args(["--launch", "threads"])
        .output()
        .expect("run ep-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert_eq!(stdout.lines().last(), Some("verify: 4 cases, 0 mismatches, 0 hangs"), "{stdout}");
}

/// The matrix's failure paths are not blind: a changed combine value is a mismatch with its
/// replay command, a rank that never comes back is a hang at the case's deadline (its peers'
/// bounded waits end first), and either makes the exit status non-zero.
#[test]
fn verify_reports_mismatches_and_hangs() {
    let out = ep_bench()
        .args(["verify", "--backend", "host", "--seed", "1", "--cases", "2"])
        .args(["--launch", "threads"])
        .env("FEP_TEST_VERIFY_CORRUPT", "1")
        .output()
        .expect("run ep-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("MISMATCH") && stdout.contains("combined_x"), "{stdout}");
    assert!(
        stdout
            .contains("replay: ep-bench verify --backend host --seed 1 --case 0 --launch threads"),
        "{stdout}"
    );
    let last = stdout.lines().last().unwrap_or("");
    assert!(last.starts_with("verify: 2 cases, ") && last.ends_with(", 0 hangs"), "{last}");
    assert!(!last.contains(" 0 mismatches"), "{last}");
    // A stalled rank: the smallest multi-rank case of seed 1 as threads.
    let i = (0..200)
        .find(|&i| {
            let c = draw_case(1, i, VerifyBackend::Host, Launch::Threads);
            c.num_ranks == 2 && c.shapes.len() == 1
        })
        .expect("a 2-rank case");
    let t = std::time::Instant::now();
    let out = ep_bench()
        .args(["verify", "--backend", "host", "--seed", "1", "--case", &i.to_string()])
        .args(["--launch", "threads", "--timeout", "1"])
        .env("FEP_TEST_VERIFY_STALL_RANK", "1")
        .output()
        .expect("run ep-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("HANG") && stdout.contains("ranks [1] still running"), "{stdout}");
    assert!(stdout.contains("timed out"), "the peer's bounded wait is reported: {stdout}");
    assert_eq!(stdout.lines().last(), Some("verify: 1 cases, 0 mismatches, 1 hangs"), "{stdout}");
    assert!(t.elapsed() < Duration::from_secs(90), "{:?}", t.elapsed());
}

/// `--jobs 2` runs process cases two at a time: same cases, same verdicts and the same output
/// digest as one after another, and its passes agree with each other; `--jobs` with ranks as
/// threads is refused by name.
#[test]
fn verify_jobs_run_cases_at_once_with_the_same_outputs() {
    let run = |extra: &[&str]| {
        let out = ep_bench()
            .args(["verify", "--backend", "host", "--seed", "5", "--cases", "3"])
            .args(["--launch", "procs"])
            .args(extra)
            .output()
            .expect("run ep-bench");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        let digest = stdout
            .lines()
            .find_map(|l| l.strip_prefix("output digest "))
            .map(|l| l.split(' ').next().unwrap_or("").to_string())
            .unwrap_or_else(|| panic!("no digest line: {stdout}"));
        (stdout, digest)
    };
    let (_, one) = run(&[]);
    let (stdout, two) = run(&["--jobs", "2", "--repeat", "2"]);
    assert_eq!(one, two, "{stdout}");
    assert!(stdout.contains("(all 2 passes bit-identical)"), "{stdout}");
    assert_eq!(stdout.lines().last(), Some("verify: 6 cases, 0 mismatches, 0 hangs"), "{stdout}");
    let out = ep_bench()
        .args(["verify", "--backend", "host", "--cases", "1", "--jobs", "2", "--launch", "threads"])
        .output()
        .expect("run ep-bench");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("invalid argument --jobs"), "{stderr}");
}
