//! Mutation fuzzing of every decoder of bytes that come from a peer or the store: connection
//! blobs, remote region descriptors, immediate data, notify records and the receive plan built
//! from them, low-latency arrival counts, token records, the hierarchy's row metadata and the
//! store's wire protocol. Each decoder must return (Ok or an error) for any input: a panic is
//! a failure, and an error about a peer must name a rank of the job.
//!
//! Inputs are valid encodings mutated (bit flips, interesting numbers written over fields,
//! truncation, extension, splices) plus raw random bytes, from a fixed seed. The default budget
//! (`FEP_FUZZ_CASES`, 20000 per decoder) takes seconds; the offline run sets it to 10 million
//! (release build: `FEP_FUZZ_CASES=10000000 cargo test --release --test fuzz_decoders --
//! --nocapture`). `FEP_FUZZ_SEED` picks another seed; `FEP_FUZZ_ONLY` one decoder by name.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use fabric_ep::error::Error;
use fabric_ep::fabric::RemoteRegion;
use fabric_ep::protocol::config::{DispatchDtype, EpConfig, EpSettings};
use fabric_ep::protocol::plan::{
    imm_decode, ImmCodec, LlImm, LlMsg, LlRecvLayout, NormalImm, NormalMsg, NotifyRecord,
    RecordLayout, RecvPlan,
};

/// xorshift64*: fast, and the same sequence on every machine for a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    fn chance(&mut self, one_in: u64) -> bool {
        self.next() % one_in == 0
    }
    /// A number near a boundary a decoder might get wrong.
    fn interesting(&mut self) -> u64 {
        const V: [u64; 16] = [
            0,
            1,
            2,
            3,
            0x7f,
            0xff,
            0x7fff,
            0xffff,
            0x3fff,
            0x4000,
            0x7fff_ffff,
            0x8000_0000,
            0xffff_ffff,
            0x1_0000_0000,
            0x7fff_ffff_ffff_ffff,
            u64::MAX,
        ];
        match self.below(4) {
            0 => V[self.below(V.len())].wrapping_sub(self.below(2) as u64),
            1 => 1u64 << self.below(64),
            _ => V[self.below(V.len())],
        }
    }
}

/// One mutated input from `seeds`.
fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    if rng.chance(16) {
        let n = rng.below(96);
        return (0..n).map(|_| rng.next() as u8).collect();
    }
    let mut b = seeds[rng.below(seeds.len())].clone();
    for _ in 0..1 + rng.below(4) {
        match rng.below(8) {
            0 | 1 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            2 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] = rng.interesting() as u8;
            }
            3 | 4 if b.len() >= 4 => {
                // A little-endian u32 or u64 field overwritten at a word boundary (most fields
                // are aligned) or anywhere.
                let w = if rng.chance(2) { 4 } else { 8 }.min(b.len());
                let mut i = rng.below(b.len() - w + 1);
                if rng.chance(2) {
                    i -= i % w;
                }
                let v = rng.interesting().to_le_bytes();
                b[i..i + w].copy_from_slice(&v[..w]);
            }
            5 if rng.chance(2) => {
                let n = rng.below(b.len() + 1);
                b.truncate(n);
            }
            5 if b.len() >= 16 => {
                // One number written into two aligned fields: a length and the count that must
                // agree with it, both huge.
                let v = rng.interesting().to_le_bytes();
                for _ in 0..2 {
                    let i = rng.below(b.len() / 8) * 8;
                    b[i..i + 8].copy_from_slice(&v);
                }
            }
            6 => {
                let n = 1 + rng.below(16);
                b.extend((0..n).map(|_| rng.next() as u8));
            }
            _ if !b.is_empty() => {
                // Splice: a copy of one range over another.
                let (i, j) = (rng.below(b.len()), rng.below(b.len()));
                let n = rng.below(b.len() - i.max(j) + 1);
                let c = b[i..i + n].to_vec();
                b[j..j + n].copy_from_slice(&c);
            }
            _ => {}
        }
    }
    b
}

fn cases() -> u64 {
    std::env::var("FEP_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000)
}

/// Runs `check` on `n` inputs; it returns Err(reason) for an invariant broken without a panic.
fn fuzz(name: &str, seeds: Vec<Vec<u8>>, check: impl Fn(&[u8]) -> Result<(), String>) {
    if std::env::var("FEP_FUZZ_ONLY").is_ok_and(|o| !name.contains(&o)) {
        return;
    }
    let seed = std::env::var("FEP_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1u64);
    let mut rng = Rng(seed ^ 0x9e37_79b9_7f4a_7c15 ^ name.len() as u64);
    let n = cases();
    let start = Instant::now();
    let (mut ok, mut refused) = (0u64, 0u64);
    quiet_panics();
    FUZZING.with(|f| f.set(true));
    let mut failure = None;
    for i in 0..n {
        let input = if i < seeds.len() as u64 {
            seeds[i as usize].clone()
        } else {
            mutate(&mut rng, &seeds)
        };
        match catch_unwind(AssertUnwindSafe(|| check(&input))) {
            Ok(Ok(())) => ok += 1,
            Ok(Err(why)) if why.is_empty() => refused += 1,
            Ok(Err(why)) => {
                failure = Some(format!("input {i} ({}): {why}", hex(&input)));
                break;
            }
            Err(p) => {
                let what = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                failure = Some(format!("input {i} panicked ({what}): {}", hex(&input)));
                break;
            }
        }
    }
    FUZZING.with(|f| f.set(false));
    println!(
        "fuzz {name}: {} inputs, {ok} decoded, {refused} refused, {} failures ({:.2} s)",
        ok + refused + u64::from(failure.is_some()),
        u64::from(failure.is_some()),
        start.elapsed().as_secs_f64()
    );
    if let Some(f) = failure {
        panic!("fuzz {name}: {f}");
    }
}

thread_local! {
    static FUZZING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Panics on a thread that is fuzzing are caught and reported with their input, so the default
/// hook's message (one per panicking input) is skipped there; other threads keep it.
fn quiet_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !FUZZING.with(|f| f.get()) {
                default(info)
            }
        }));
    });
}

fn hex(b: &[u8]) -> String {
    b.iter().take(256).map(|x| format!("{x:02x}")).collect()
}

/// Ok for a decode, Err("") for a refusal; a refusal that blames a peer must blame a real one.
fn judged<T>(r: Result<T, Error>, world: usize) -> Result<(), String> {
    match r {
        Ok(_) => Ok(()),
        Err(Error::Protocol { peer, .. }) if peer >= world => {
            Err(format!("a protocol error names rank {peer} of {world}"))
        }
        Err(_) => Err(String::new()),
    }
}

fn word(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    let s = b.get(i * 8..).unwrap_or(&[]);
    let n = s.len().min(8);
    w[..n].copy_from_slice(&s[..n]);
    u64::from_le_bytes(w)
}

fn settings(r: usize, e: usize, h: usize, k: usize) -> EpSettings {
    let mut s = EpSettings::new(0, r, e, h, k);
    s.max_tokens_per_rank = 64;
    s
}

#[test]
fn connect_blob() {
    let region = |len: u64, chunk: u64, virt: bool| {
        let n = len.div_ceil(chunk);
        RemoteRegion { base: 0x1000, len, chunk, virt_addr: virt, keys: (0..n).collect() }
    };
    let blob = |header: &[u8], name: &[u8], r: &RemoteRegion| {
        let mut b = (header.len() as u32).to_le_bytes().to_vec();
        b.extend_from_slice(header);
        b.extend_from_slice(&(name.len() as u32).to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&r.to_bytes());
        b
    };
    let seeds = vec![
        blob(&42u64.to_le_bytes(), &[7; 16], &region(4096, 4096, true)),
        blob(&[], &[1; 32], &region(5000, 1024, false)),
        blob(&[9; 24], &[2; 56], &region(1 << 20, 1 << 18, true)),
    ];
    fuzz("connect_blob", seeds, |b| match fabric_ep::ep::connect::parse_blob(1, 3, b, 1024) {
        Ok(p) => {
            if p.region.len < 1024
                || p.region.keys.len() as u64 != p.region.len.div_ceil(p.region.chunk)
            {
                return Err(format!("accepted an inconsistent region {:?}", p.region));
            }
            Ok(())
        }
        Err(Error::Protocol { peer: 3, rank: 1, .. }) => Err(String::new()),
        Err(e) => Err(format!("not a protocol error naming peer 3: {e}")),
    });
}

#[test]
fn remote_region() {
    let r = RemoteRegion { base: 7, len: 3000, chunk: 1024, virt_addr: true, keys: vec![1, 2, 3] };
    let one = RemoteRegion { base: 0, len: 1, chunk: 1, virt_addr: false, keys: vec![9] };
    fuzz("remote_region", vec![r.to_bytes(), one.to_bytes()], |b| {
        match RemoteRegion::from_bytes(b) {
            Ok(r) => {
                // A region that parsed must round-trip (flags other than bit 0 are ignored).
                if RemoteRegion::from_bytes(&r.to_bytes()).ok().as_ref() != Some(&r) {
                    return Err("does not round-trip".into());
                }
                let _ = r.target(word(b, 0), 8);
                Ok(())
            }
            Err(_) => Err(String::new()),
        }
    });
}

#[test]
fn normal_immediates() {
    // Input: [num_ranks u16, slots_per_peer u8, imm u32, ...].
    let seeds = vec![
        vec![8, 0, 4, 1, 2, 3, 4],
        vec![0, 4, 127, 0xff, 0xff, 0xff, 0xff],
        vec![1, 0, 1, 0, 0, 0, 0],
    ];
    fuzz("normal_imm", seeds, |b| {
        let r = u16::from_le_bytes([*b.first().unwrap_or(&1), *b.get(1).unwrap_or(&0)]) as u64;
        let spp = *b.get(2).unwrap_or(&1) as u64;
        let imm = word(b.get(3..).unwrap_or(&[]), 0) as u32;
        let Ok(c) = NormalImm::new(r, spp) else { return Err(String::new()) };
        match c.decode(imm) {
            Ok(m) => {
                let (_, value) = imm_decode(imm);
                let back = match m {
                    NormalMsg::Data { phase, src, slot, rows } => c.data(phase, src, slot, rows),
                    NormalMsg::Notify { src, seq14 } => c.notify(src, seq14),
                    NormalMsg::Credit { src, chunks } => c.credit(src, chunks),
                };
                match back {
                    Ok(v) if v == imm => Ok(()),
                    other => Err(format!("{m:?} (value {value}) re-encodes as {other:?}")),
                }
            }
            Err(_) => Err(String::new()),
        }
    });
}

#[test]
fn ll_immediates() {
    // Input: [num_ranks u8, experts per rank u8, imm u32, ...].
    let seeds =
        vec![vec![8, 4, 1, 2, 3, 4], vec![1, 1, 0, 0, 0, 0], vec![16, 16, 0xff, 0xff, 0x0f, 0]];
    fuzz("ll_imm", seeds, |b| {
        let r = (*b.first().unwrap_or(&1)).max(1) as u64;
        let e = r * (*b.get(1).unwrap_or(&1)) as u64;
        let imm = word(b.get(2..).unwrap_or(&[]), 0) as u32;
        let Ok(c) = LlImm::new(r, e) else { return Err(String::new()) };
        match c.decode(imm) {
            Ok(m) => {
                let back = match m {
                    LlMsg::Dispatch { set, local_expert, src, count } => {
                        c.dispatch(set, local_expert, src, count)
                    }
                    LlMsg::Combine { set, src, local_expert, count } => {
                        c.combine(set, src, local_expert, count)
                    }
                };
                match back {
                    Ok(v) if v == imm => Ok(()),
                    other => Err(format!("{m:?} re-encodes as {other:?}")),
                }
            }
            Err(_) => Err(String::new()),
        }
    });
}

#[test]
fn proxy_immediates() {
    fuzz(
        "imm_codec",
        vec![vec![14, 1, 2, 3, 4], vec![0, 0, 0, 0, 0], vec![32, 0xff, 0xff, 0xff, 0xff]],
        |b| {
            let bits = *b.first().unwrap_or(&0) as u32;
            let imm = word(b.get(1..).unwrap_or(&[]), 0) as u32;
            let Ok(c) = ImmCodec::new(bits) else { return Err(String::new()) };
            let (slot, value) = c.decode(imm);
            match c.encode(slot, value) {
                Ok(v) if v == imm => Ok(()),
                other => Err(format!("({slot}, {value}) re-encodes as {other:?}")),
            }
        },
    );
}

#[test]
fn notify_records() {
    // Four peers, 16 experts (4 local), top-4: the records each peer sent this rank, back to
    // back, then the expert alignment byte.
    let cfg = EpConfig::new(settings(4, 16, 128, 4)).expect("config");
    let layout = *cfg.normal_layout();
    let l = cfg.num_local_experts() as u64;
    let rec_bytes = NotifyRecord::bytes(l) as usize;
    let mk = |counts: &[(u32, [u32; 4])]| {
        let mut b = Vec::new();
        for (n, per) in counts {
            let r = NotifyRecord { seq: 0, num_tokens: *n, tokens_per_local_expert: per.to_vec() };
            let mut out = vec![0u8; rec_bytes];
            r.encode(&mut out).expect("encode");
            b.extend_from_slice(&out);
        }
        b.push(1);
        b
    };
    let seeds = vec![
        mk(&[(3, [1, 1, 1, 0]), (0, [0; 4]), (5, [5, 5, 5, 5]), (1, [0, 0, 0, 1])]),
        mk(&[(0, [0; 4]); 4]),
        mk(&[(64, [64, 64, 64, 64]), (2, [2, 0, 0, 0]), (7, [1, 2, 3, 1]), (0, [0; 4])]),
    ];
    fuzz("notify_recv_plan", seeds, |b| {
        let records = (0..4)
            .map(|s| NotifyRecord::decode(b.get(s * rec_bytes..).unwrap_or(&[]), l))
            .collect::<Result<Vec<_>, _>>();
        let Ok(records) = records else { return Err(String::new()) };
        let align = *b.get(4 * rec_bytes).unwrap_or(&1) as u64;
        let worst = b.get(4 * rec_bytes + 1).map(|&w| w as u64 * 1000);
        match RecvPlan::new(2, &records, &layout, align, worst) {
            Ok(p) => {
                let sum: u64 = records.iter().map(|r| r.num_tokens as u64).sum();
                if p.num_recv_tokens != sum || p.rank_prefix.windows(2).any(|w| w[0] > w[1]) {
                    return Err(format!("plan {p:?} from {records:?}"));
                }
                if records.iter().any(|r| r.num_tokens > i32::MAX as u32) {
                    return Err("accepted more than 2^31 - 1 tokens from a peer".into());
                }
                Ok(())
            }
            Err(e) => judged::<()>(Err(e), 4),
        }
    });
}

#[test]
fn ll_arrival_counts() {
    let cfg = EpConfig::new(settings(4, 8, 128, 2)).expect("config");
    let layout = *cfg.ll_layout();
    let n = 8; // L = 2 local experts x R = 4 sources
    let seeds = vec![
        (0..n).flat_map(|i| (i as u32 % 5).to_le_bytes()).collect(),
        vec![0; 4 * n],
        (0..n).flat_map(|_| 64u32.to_le_bytes()).collect(),
    ];
    fuzz("ll_recv_layout", seeds, |b| {
        let counts: Vec<u32> =
            (0..n).map(|i| word(b.get(4 * i..).unwrap_or(&[]), 0) as u32).collect();
        match LlRecvLayout::new(1, &counts, &layout) {
            Ok(lay) => {
                for e in 0..2 {
                    for s in 0..4 {
                        let (begin, c) = lay.range(e, s, 4).ok_or("no range")?;
                        if c as u64 > 64 || begin as u64 + c as u64 > 4 * 64 {
                            return Err(format!(
                                "expert {e} source {s}: rows {begin}+{c} past 4 * 64"
                            ));
                        }
                    }
                }
                Ok(())
            }
            Err(e) => judged::<()>(Err(e), 4),
        }
    });
}

#[test]
fn token_records() {
    let layouts = [
        RecordLayout::normal_dispatch(128, DispatchDtype::Bf16, 4).expect("layout"),
        RecordLayout::normal_dispatch(256, DispatchDtype::Fp8E4m3, 8).expect("layout"),
        RecordLayout::ll_dispatch(128, DispatchDtype::Fp8E4m3).expect("layout"),
        RecordLayout::ll_dispatch(128, DispatchDtype::Bf16).expect("layout"),
    ];
    let seeds = layouts.iter().enumerate().map(|(i, l)| {
        let mut b = vec![i as u8];
        b.extend((0..l.bytes).map(|j| j as u8));
        b
    });
    fuzz("token_record", seeds.collect(), |b| {
        let Some((&which, rec)) = b.split_first() else { return Err(String::new()) };
        let l = layouts[which as usize % layouts.len()];
        match l.read(rec) {
            Ok(v) => {
                let _ = v.payload().len();
                for i in 0..20 {
                    let _ = (v.scale(i), v.topk_idx(i), v.topk_weight(i));
                }
                let _ = v.src_idx();
                Ok(())
            }
            Err(_) => Err(String::new()),
        }
    });
}

#[test]
fn hierarchy_row_metadata() {
    // 2 nodes of 4 ranks; this rank is 5. Input: rows of (node u32, token u32, gateway u8).
    let mut s = settings(8, 16, 128, 2);
    s.rank = 5;
    s.ranks_per_node = 4;
    let cfg = EpConfig::new(s).expect("config");
    let row = |m: u32, t: u32, g: u8| {
        let mut b = m.to_le_bytes().to_vec();
        b.extend_from_slice(&t.to_le_bytes());
        b.push(g);
        b
    };
    let seeds = vec![
        [row(0, 1, 0), row(1, 7, 3), row(0, 2, 2)].concat(),
        [row(1, 0, 1), row(1, 1, 1)].concat(),
        vec![],
    ];
    fuzz("hier_final_order", seeds, |b| {
        let rows: Vec<&[u8]> = b.chunks_exact(9).collect();
        let meta: Vec<(u32, u32)> =
            rows.iter().map(|r| (word(r, 0) as u32, word(&r[4..], 0) as u32)).collect();
        let gateway: Vec<usize> = rows.iter().map(|r| r[8] as usize % 4).collect();
        match fabric_ep::protocol::hier::final_order(&cfg, &meta, &gateway) {
            Ok((perm, prefix, src_idx)) => {
                let mut seen = vec![false; meta.len()];
                for &p in &perm {
                    if std::mem::replace(&mut seen[p as usize], true) {
                        return Err("perm is not a permutation".into());
                    }
                }
                if prefix.last().copied() != Some(meta.len() as u64)
                    || src_idx.iter().any(|&s| s < 0)
                {
                    return Err(format!("prefix {prefix:?}, src_idx {src_idx:?}"));
                }
                Ok(())
            }
            Err(e) => judged::<()>(Err(e), 8),
        }
    });
}

#[test]
fn store_wire() {
    use fabric_ep::bootstrap::fuzz;
    let frame = |kind: u8, payload: &[u8]| {
        let mut b = ((payload.len() + 1) as u32).to_le_bytes().to_vec();
        b.push(kind);
        b.extend_from_slice(payload);
        b
    };
    let hello = [
        &b"FEPB"[..],
        &2u32.to_le_bytes(),
        &3u64.to_le_bytes(),
        &8u64.to_le_bytes(),
        &0u32.to_le_bytes(),
        &1u64.to_le_bytes(),
        &[5u8; 32],
    ]
    .concat();
    let proof = [&[9u8; 32][..], &4u32.to_le_bytes(), b"job1"].concat();
    let contribute = [&7u64.to_le_bytes()[..], &5000u64.to_le_bytes(), b"data"].concat();
    let failed_timeout = [
        &[7u8][..],
        &2u64.to_le_bytes(),
        &[1],
        &2u64.to_le_bytes(),
        &1u64.to_le_bytes(),
        &3u64.to_le_bytes(),
    ]
    .concat();
    let failed_gone = [&[7u8][..], &2u64.to_le_bytes(), &[2], &6u64.to_le_bytes()].concat();
    let failed_proto =
        [&[7u8][..], &2u64.to_le_bytes(), &[4], &3u32.to_le_bytes(), b"bad"].concat();
    let gathered = [&[5u8][..], &2u64.to_le_bytes(), &8u64.to_le_bytes()].concat();
    let gone = [&[10u8][..], &3u64.to_le_bytes()].concat();
    let seeds = vec![
        [&[1u8][..], &hello].concat(),
        [&[9u8][..], &proof].concat(),
        [&[2u8][..], &contribute].concat(),
        failed_timeout,
        failed_gone,
        failed_proto,
        gathered,
        gone,
    ];
    fuzz("store_messages", seeds, |b| {
        let Some((&kind, payload)) = b.split_first() else { return Err(String::new()) };
        let r = match kind {
            1 | 2 | 9 => fuzz::to_store(kind, payload),
            _ => fuzz::to_rank(kind, payload, 8),
        };
        r.map_err(|_| String::new())
    });
    let stream = [frame(1, &hello), frame(9, &proof), frame(2, &contribute), vec![3, 0]].concat();
    fuzz("store_frames", vec![stream], |b| match fuzz::frames(b, 4096) {
        Ok(n) if n <= b.len() / 5 => Ok(()),
        Ok(n) => Err(format!("{n} frames from {} bytes", b.len())),
        Err(_) => Err(String::new()),
    });
}
