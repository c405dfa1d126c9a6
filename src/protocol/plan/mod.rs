//! Protocol math shared by the CUDA kernels, the proxy and the host backend: record layouts,
//! buffer offsets, immediate data, chunk/credit bookkeeping, receive plans and cluster sizing.
//! Pure: no GPU, no NIC, no threads. Plain structs, `u64` byte offsets, slices in, `Vec`s out.
//!
//! Vocabulary: `R` = num_ranks, `E` = num_experts, `L` = E / R local experts per rank,
//! `spp` = slots_per_peer, `C` = chunk_tokens, `M` = max_tokens_per_rank. Global expert `g`
//! lives on rank `g / L` as local expert `g % L`.
//!
//! # Wire records
//! Every token crosses the wire as one record of little-endian fields, padded to 16 bytes:
//!
//! | record            | payload                 | scales (f32)  | topk idx (i32) | topk w (f32) | src idx (i32) |
//! |-------------------|-------------------------|---------------|----------------|--------------|---------------|
//! | normal dispatch   | bf16 `2H` / e4m3 `H`    | fp8: `H/128`  | `K`, local ids | `K`          | 1             |
//! | normal combine    | bf16 `2H`               | -             | -              | `K`          | -             |
//! | LL dispatch       | bf16 `2H` / e4m3 `H`    | fp8: `H/128`  | -              | -            | 1             |
//! | LL combine        | bf16 `2H`               | -             | -              | -            | -             |
//!
//! Fields follow each other in the table's order with no gaps (all 4-byte aligned, the payload
//! 16-byte aligned because `H % 8 == 0`). The normal-dispatch topk ids are already local to the
//! destination rank (`-1` where the expert is not there or the entry was `-1`), and the weights
//! are 0 there, as DeepEP's sender does; the receiver copies both verbatim.
//!
//! # Immediate data
//! Every RMA write carries a `u32`: `slot_id = imm >> 14` (18 bits), `value = imm & 0x3fff`.
//! See [`NormalImm`] and [`LlImm`] for the id spaces.
//!
//! The parts, each a submodule re-exported here (paths such as `protocol::plan::NormalLayout`
//! are the API): constants and input checks (`base`), wire records, immediate data, memory
//! regions, normal mode, low-latency mode, cluster sizing and its table.

mod base;
mod cluster;
mod imm;
mod ll;
mod normal;
mod record;
mod region;
mod table;

pub use base::*;
pub use cluster::*;
pub use imm::*;
pub use ll::*;
pub use normal::*;
pub use record::*;
pub use region::*;
pub use table::*;

// Index loops over ranks/tokens/channels read closest to the math they check.
#[allow(clippy::needless_range_loop, clippy::type_complexity)]
#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::dtype::DispatchDtype;
    use crate::protocol::quant::{bf16_to_f32, f32_to_bf16, quantize_row_bf16};
    use crate::protocol::reference::tests::{random_bf16, random_topk};
    use crate::protocol::reference::{self as refm, Tokens, TokensRef};
    use crate::util::SplitMix64;
    use crate::Error;

    const BF16: DispatchDtype = DispatchDtype::Bf16;
    const FP8: DispatchDtype = DispatchDtype::Fp8E4m3;

    #[test]
    fn record_layouts_at_deepseek_sizes() {
        let r = RecordLayout::normal_dispatch(7168, BF16, 8).unwrap();
        assert_eq!(
            (r.payload_bytes, r.topk_idx_offset, r.topk_weights_offset, r.src_idx_offset, r.bytes),
            (14336, 14336, 14368, Some(14400), 14416)
        );
        let r = RecordLayout::normal_dispatch(7168, FP8, 8).unwrap();
        assert_eq!(
            (r.payload_bytes, r.scales_offset, r.num_scales, r.topk_idx_offset, r.bytes),
            (7168, 7168, 56, 7392, 7472)
        );
        assert_eq!(RecordLayout::normal_combine(7168, 8).unwrap().bytes, 14368);
        assert_eq!(RecordLayout::ll_dispatch(7168, BF16).unwrap().bytes, 14464);
        assert_eq!(RecordLayout::ll_dispatch(7168, FP8).unwrap().bytes, 7424);
        for h in (128..8192).step_by(128) {
            for dt in [BF16, FP8] {
                let r = RecordLayout::ll_dispatch(h, dt).unwrap();
                assert_eq!(r.bytes % LL_DISPATCH_RECORD_ALIGN, 0, "{h} {dt:?}");
                assert_eq!(r.scales_offset % 16, 0, "{h} {dt:?}: the tail is written in 16 B");
            }
        }
        assert_eq!(RecordLayout::ll_combine(7168).unwrap().bytes, 14336);
        for h in (8..2048).step_by(8) {
            for k in [0, 1, 3, 8, 9] {
                let r = RecordLayout::normal_dispatch(h, BF16, k).unwrap();
                assert_eq!(r.bytes % RECORD_ALIGN, 0);
                assert!(r.bytes >= 2 * h + 8 * k + 4 && r.bytes < 2 * h + 8 * k + 4 + 16);
            }
        }
        assert!(matches!(
            RecordLayout::normal_dispatch(7176, FP8, 8),
            Err(Error::InvalidArgument { arg: "hidden", .. })
        ));
        assert!(matches!(
            RecordLayout::ll_combine(12),
            Err(Error::InvalidArgument { arg: "hidden", .. })
        ));
    }

    #[test]
    fn record_write_read_round_trip() {
        let r = RecordLayout::normal_dispatch(256, FP8, 3).unwrap();
        let payload: Vec<u8> = (0..256).map(|i| i as u8).collect();
        let mut out = vec![0xAAu8; r.bytes as usize + 5];
        let f = RecordFields {
            payload: &payload,
            scales: &[0.5, 2.0],
            topk_idx: &[3, -1, 0],
            topk_weights: &[0.25, 0.0, 1.5],
            src_idx: 12345,
        };
        r.write(&mut out, &f).unwrap();
        let v = r.read(&out).unwrap();
        assert_eq!(v.payload(), &payload[..]);
        assert_eq!((v.scale(0), v.scale(1), v.scale(2)), (Some(0.5), Some(2.0), None));
        assert_eq!(
            (0..4).map(|k| v.topk_idx(k)).collect::<Vec<_>>(),
            vec![Some(3), Some(-1), Some(0), None]
        );
        assert_eq!(v.topk_weight(2), Some(1.5));
        assert_eq!(v.src_idx(), Some(12345));
        let end = r.src_idx_offset.unwrap() as usize + 4;
        assert!(out[end..r.bytes as usize].iter().all(|&b| b == 0), "padding zeroed");
        assert!(out[r.bytes as usize..].iter().all(|&b| b == 0xAA), "nothing past the record");
        let short = RecordFields { scales: &[1.0], ..f };
        assert!(matches!(
            r.write(&mut out, &short),
            Err(Error::InvalidArgument { arg: "scales", .. })
        ));
        assert!(matches!(
            r.write(&mut out[..10], &f),
            Err(Error::InvalidArgument { arg: "out", .. })
        ));
        assert!(matches!(r.read(&out[..10]), Err(Error::InvalidArgument { arg: "rec", .. })));
    }

    #[test]
    fn local_topk_matches_deepep_sender() {
        let idx = [5i64, -1, 2, 3, 7];
        let w = [0.1f32, 0.2, 0.3, 0.4, 0.5];
        let (mut oi, mut ow) = ([0i32; 5], [0f32; 5]);
        to_local_topk(&idx, &w, 1, 2, &mut oi, &mut ow).unwrap(); // rank 1 holds experts 2, 3
        assert_eq!(oi, [-1, -1, 0, 1, -1]);
        assert_eq!(ow, [0.0, 0.0, 0.3, 0.4, 0.0]);
        assert!(to_local_topk(&idx, &w[..4], 1, 2, &mut oi, &mut ow).is_err());
    }

    #[test]
    fn imm_ids_are_unique_and_decode_back() {
        for (r, spp) in [(1u64, 1u64), (3, 2), (8, 5)] {
            let imm = NormalImm::new(r, spp).unwrap();
            let mut seen = std::collections::HashSet::new();
            for phase in [Phase::Dispatch, Phase::Combine] {
                for src in 0..r {
                    for slot in 0..spp {
                        let v = imm.data(phase, src, slot, 77).unwrap();
                        assert!(seen.insert(v >> IMM_VALUE_BITS));
                        assert_eq!(
                            imm.decode(v).unwrap(),
                            NormalMsg::Data { phase, src, slot, rows: 77 }
                        );
                    }
                }
            }
            for src in 0..r {
                let v = imm.notify(src, 0x4005).unwrap();
                assert!(seen.insert(v >> IMM_VALUE_BITS));
                assert_eq!(imm.decode(v).unwrap(), NormalMsg::Notify { src, seq14: 5 });
                let v = imm.credit(src, 3).unwrap();
                assert!(seen.insert(v >> IMM_VALUE_BITS));
                assert_eq!(imm.decode(v).unwrap(), NormalMsg::Credit { src, chunks: 3 });
            }
            assert_eq!(seen.len() as u64, imm.num_ids());
            assert!(seen.iter().all(|&id| (id as u64) < imm.num_ids()));
            assert!(imm.decode((imm.num_ids() as u32) << IMM_VALUE_BITS).is_err());
            assert!(imm.data(Phase::Dispatch, r, 0, 1).is_err());
            assert!(imm.data(Phase::Dispatch, 0, spp, 1).is_err());
            assert!(matches!(
                imm.data(Phase::Dispatch, 0, 0, 1 << 14),
                Err(Error::InvalidArgument { arg: "value", .. })
            ));
        }
        for (r, e) in [(1u64, 1u64), (2, 6), (4, 4)] {
            let imm = LlImm::new(r, e).unwrap();
            let l = e / r;
            let mut seen = std::collections::HashSet::new();
            for set in 0..2 {
                for src in 0..r {
                    for le in 0..l {
                        let v = imm.dispatch(set, le, src, 9).unwrap();
                        assert!(seen.insert(v >> IMM_VALUE_BITS));
                        let m = LlMsg::Dispatch { set, local_expert: le, src, count: 9 };
                        assert_eq!(imm.decode(v).unwrap(), m);
                        let v = imm.combine(set, src, le, 0).unwrap();
                        assert!(seen.insert(v >> IMM_VALUE_BITS));
                        let m = LlMsg::Combine { set, src, local_expert: le, count: 0 };
                        assert_eq!(imm.decode(v).unwrap(), m);
                    }
                }
            }
            assert_eq!(seen.len() as u64, imm.num_ids());
            assert!(imm.decode((imm.num_ids() as u32) << IMM_VALUE_BITS).is_err());
            assert!(imm.dispatch(2, 0, 0, 0).is_err());
        }
        // The limits: 18 bits of ids.
        assert!(NormalImm::new(1 << 16, 1).is_ok());
        assert!(matches!(
            NormalImm::new(1 << 16, 2),
            Err(Error::InvalidArgument { arg: "slots_per_peer", .. })
        ));
        assert!(matches!(
            NormalImm::new(1 << 17, 1),
            Err(Error::InvalidArgument { arg: "num_ranks", .. })
        ));
        assert!(LlImm::new(1, 1 << 16).is_ok());
        assert!(matches!(
            LlImm::new(1, (1 << 16) + 1),
            Err(Error::InvalidArgument { arg: "num_experts", .. })
        ));
        assert_eq!(imm_decode(imm_encode((1 << 18) - 1, 0x3fff).unwrap()), ((1 << 18) - 1, 0x3fff));
        assert!(imm_encode(1 << 18, 0).is_err());
    }

    #[test]
    fn region_plans_never_split_a_unit() {
        for (unit, units, max) in [(100u64, 10u64, 250u64), (7, 1, 7), (16, 1000, 4096), (5, 0, 5)]
        {
            let p = RegionPlan::new(unit, units, max).unwrap();
            assert_eq!(p.num_regions, if units == 0 { 0 } else { units.div_ceil(max / unit) });
            let mut covered = 0;
            for i in 0..p.num_regions {
                let (off, len) = p.region_range(i).unwrap();
                assert_eq!(off, covered);
                assert!(len <= max && len % unit == 0 && len > 0);
                covered += len;
            }
            assert_eq!(covered, p.total_bytes());
            for u in 0..units {
                let (r0, o0) = p.locate(u * unit).unwrap();
                let (r1, o1) = p.locate(u * unit + unit - 1).unwrap();
                assert_eq!(r0, r1, "unit {u} split");
                assert_eq!(o1, o0 + unit - 1);
                assert_eq!(p.region_range(r0).unwrap().0 + o0, u * unit);
            }
            assert!(p.locate(p.total_bytes()).is_err());
        }
        assert!(matches!(
            RegionPlan::new(100, 3, 99),
            Err(Error::InvalidArgument { arg: "max_region_bytes", .. })
        ));
    }

    #[test]
    fn chunk_math() {
        let l = NormalLayout::from_parts(2, 2, 8, 1, BF16, 5, 3).unwrap();
        assert_eq!(
            (l.num_chunks(0), l.num_chunks(1), l.num_chunks(5), l.num_chunks(6)),
            (0, 1, 1, 2)
        );
        for n in 0..40 {
            let rows: Vec<u64> = (0..l.num_chunks(n)).map(|k| l.chunk_rows(n, k)).collect();
            assert_eq!(rows.iter().sum::<u64>(), n);
            assert!(rows.iter().all(|&r| (1..=5).contains(&r)));
            assert_eq!(l.chunk_rows(n, l.num_chunks(n)), 0);
            let mut at = 0;
            for k in 0..l.num_chunks(n) {
                let (b, e) = l.chunk_range(n, k);
                assert_eq!((b, e - b), (at, rows[k as usize]));
                at = e;
            }
        }
        assert_eq!(l.chunk_slot(7), 1);
        assert_eq!(l.recv_slot_offset(1, 2).unwrap(), 5 * l.slot_bytes);
        assert!(l.recv_slot_offset(2, 0).is_err() && l.recv_slot_offset(0, 3).is_err());
        assert_eq!(l.notify_offset(1, 3).unwrap(), 3 * l.notify_record_bytes);
        assert!(l.row_offset(Phase::Dispatch, 5).is_err());
    }

    #[test]
    fn notify_records_round_trip_and_are_bounds_checked() {
        let rec = NotifyRecord { seq: 7, num_tokens: 10, tokens_per_local_expert: vec![3, 10, 0] };
        let mut buf = vec![0xffu8; NotifyRecord::bytes(3) as usize];
        assert_eq!(buf.len(), 32);
        rec.encode(&mut buf).unwrap();
        assert_eq!(NotifyRecord::decode(&buf, 3).unwrap(), rec);
        let from = NotifyRecord::for_destination(1, 7, &[4, 10], &[1, 1, 1, 3, 10, 0]).unwrap();
        assert_eq!(from, rec);

        let layout = NormalLayout::from_parts(2, 6, 8, 2, BF16, 4, 2).unwrap();
        let ok = NotifyRecord { seq: 0, num_tokens: 5, tokens_per_local_expert: vec![5, 1, 0] };
        let p = RecvPlan::new(0, &[ok.clone(), rec.clone()], &layout, 4, None).unwrap();
        assert_eq!(p.rank_prefix, vec![0, 5, 15]);
        assert_eq!(p.tokens_per_local_expert, vec![8, 12, 0]);
        assert_eq!(p.chunks_from, vec![2, 3]);
        assert_eq!(p.out_row(&layout, 1, 2, 1).unwrap(), 5 + 9);
        assert!(p.out_row(&layout, 1, 2, 2).is_err());
        let w = RecvPlan::new(0, &[ok.clone(), rec.clone()], &layout, 1, Some(15)).unwrap();
        assert_eq!((w.num_recv_tokens, w.num_out_rows), (15, 15));
        assert!(matches!(
            RecvPlan::new(0, &[ok.clone(), rec.clone()], &layout, 1, Some(14)),
            Err(Error::InvalidArgument { arg: "num_worst_tokens", .. })
        ));
        // From the network: counts that cannot be are protocol errors naming the peer.
        let bad = NotifyRecord { seq: 0, num_tokens: 2, tokens_per_local_expert: vec![5, 0, 0] };
        assert!(matches!(
            RecvPlan::new(0, &[ok.clone(), bad], &layout, 1, None),
            Err(Error::Protocol { peer: 1, .. })
        ));
        let bad = NotifyRecord { seq: 0, num_tokens: 2, tokens_per_local_expert: vec![1, 0, 0] };
        assert!(matches!(
            RecvPlan::new(3, &[bad, ok.clone()], &layout, 1, None),
            Err(Error::Protocol { rank: 3, peer: 0, .. })
        ));
        let bad = NotifyRecord { seq: 0, num_tokens: 2, tokens_per_local_expert: vec![1, 1] };
        assert!(matches!(
            RecvPlan::new(0, &[ok.clone(), bad], &layout, 1, None),
            Err(Error::Protocol { peer: 1, .. })
        ));
        assert!(matches!(
            RecvPlan::new(0, &[ok.clone(), rec.clone()], &layout, 0, None),
            Err(Error::InvalidArgument { arg: "expert_alignment", .. })
        ));
    }

    // -----------------------------------------------------------------------------------------
    // An in-memory cluster running the normal-mode protocol through plan/, with every RMA
    // write delivered in random order, checked against the reference.
    // -----------------------------------------------------------------------------------------

    struct Write {
        src: usize,
        dst: usize,
        /// Staging offset on `src` (read at delivery, as a NIC would) or inline bytes.
        from_staging: Option<u64>,
        inline: Vec<u8>,
        len: u64,
        to_notify: bool,
        dst_off: u64,
        imm: u32,
    }

    struct Rank {
        recv: Vec<u8>,
        staging: Vec<u8>,
        notify: Vec<u8>,
        filled: Vec<Option<u64>>,
        notified: Vec<bool>,
        /// Per destination: encoded records still to send, next chunk, chunks not yet credited.
        out: Vec<Vec<Vec<u8>>>,
        next_k: Vec<u64>,
        uncredited: Vec<u64>,
        /// Per source: expected tokens (once known), next chunk to consume, records received.
        expect: Vec<Option<u64>>,
        consume_k: Vec<u64>,
        got: Vec<Vec<Vec<u8>>>,
    }

    /// Moves `streams[src][dst]` (encoded records) from every src to every dst through the
    /// bounded queues. With `notify`, `notify[src][dst]` goes first through the notify region
    /// and tells the receiver how many records to expect; otherwise the receiver knows.
    /// Returns `[dst][src]` records in arrival-consumption order and the decoded notifies.
    fn run_queues(
        layout: &NormalLayout,
        phase: Phase,
        streams: Vec<Vec<Vec<Vec<u8>>>>,
        notify: Option<Vec<Vec<NotifyRecord>>>,
        rng: &mut SplitMix64,
    ) -> (Vec<Vec<Vec<Vec<u8>>>>, Vec<Vec<NotifyRecord>>) {
        let n = layout.num_ranks as usize;
        let spp = layout.slots_per_peer;
        let rec_bytes = layout.record(phase).bytes;
        let mut ranks: Vec<Rank> = (0..n)
            .map(|me| Rank {
                recv: vec![0; layout.recv_bytes() as usize],
                staging: vec![0; layout.send_bytes() as usize],
                notify: vec![0; layout.notify_bytes() as usize],
                filled: vec![None; n * spp as usize],
                notified: vec![false; n],
                out: streams[me].clone(),
                next_k: vec![0; n],
                uncredited: vec![0; n],
                expect: (0..n)
                    .map(|s| notify.is_none().then(|| streams[s][me].len() as u64))
                    .collect(),
                consume_k: vec![0; n],
                got: vec![Vec::new(); n],
            })
            .collect();
        let mut pool: Vec<Write> = Vec::new();
        if let Some(nt) = &notify {
            for (src, row) in nt.iter().enumerate() {
                for (dst, rec) in row.iter().enumerate() {
                    let mut b = vec![0; layout.notify_record_bytes as usize];
                    rec.encode(&mut b).unwrap();
                    pool.push(Write {
                        src,
                        dst,
                        from_staging: None,
                        len: b.len() as u64,
                        inline: b,
                        to_notify: true,
                        dst_off: layout.notify_offset(src as u64, rec.seq as u64).unwrap(),
                        imm: layout.imm.notify(src as u64, rec.seq as u64).unwrap(),
                    });
                }
            }
        }
        let mut rounds = 0;
        loop {
            rounds += 1;
            assert!(rounds < 1_000_000, "no progress: deadlock");
            for me in 0..n {
                // Send: at most spp chunks in flight per destination.
                for dst in 0..n {
                    let total = ranks[me].out[dst].len() as u64;
                    while ranks[me].next_k[dst] < layout.num_chunks(total)
                        && ranks[me].uncredited[dst] < spp
                    {
                        let k = ranks[me].next_k[dst];
                        let slot = layout.chunk_slot(k);
                        let (b, e) = layout.chunk_range(total, k);
                        let off = layout.send_slot_offset(dst as u64, slot).unwrap();
                        for (i, t) in (b..e).enumerate() {
                            let at = (off + layout.row_offset(phase, i as u64).unwrap()) as usize;
                            let rec = ranks[me].out[dst][t as usize].clone();
                            ranks[me].staging[at..at + rec.len()].copy_from_slice(&rec);
                        }
                        pool.push(Write {
                            src: me,
                            dst,
                            from_staging: Some(off),
                            inline: Vec::new(),
                            len: (e - b) * rec_bytes,
                            to_notify: false,
                            dst_off: layout.recv_slot_offset(me as u64, slot).unwrap(),
                            imm: layout.imm.data(phase, me as u64, slot, e - b).unwrap(),
                        });
                        ranks[me].next_k[dst] += 1;
                        ranks[me].uncredited[dst] += 1;
                    }
                }
                // Receive: strictly in chunk order per source, credit each chunk.
                for src in 0..n {
                    let Some(total) = ranks[me].expect[src] else { continue };
                    loop {
                        let k = ranks[me].consume_k[src];
                        if k >= layout.num_chunks(total) {
                            break;
                        }
                        let slot = layout.chunk_slot(k);
                        let Some(rows) = ranks[me].filled[src * spp as usize + slot as usize]
                        else {
                            break;
                        };
                        assert_eq!(rows, layout.chunk_rows(total, k), "rows in imm");
                        let off = layout.recv_slot_offset(src as u64, slot).unwrap();
                        for i in 0..rows {
                            let at = (off + layout.row_offset(phase, i).unwrap()) as usize;
                            let rec = ranks[me].recv[at..at + rec_bytes as usize].to_vec();
                            ranks[me].got[src].push(rec);
                        }
                        ranks[me].filled[src * spp as usize + slot as usize] = None;
                        ranks[me].consume_k[src] += 1;
                        pool.push(Write {
                            src: me,
                            dst: src,
                            from_staging: None,
                            inline: Vec::new(),
                            len: 0,
                            to_notify: false,
                            dst_off: 0,
                            imm: layout.imm.credit(me as u64, 1).unwrap(),
                        });
                    }
                }
            }
            if pool.is_empty() {
                break;
            }
            let w = pool.swap_remove(rng.below(pool.len() as u64) as usize);
            let bytes = match w.from_staging {
                Some(off) => ranks[w.src].staging[off as usize..(off + w.len) as usize].to_vec(),
                None => w.inline.clone(),
            };
            let d = &mut ranks[w.dst];
            let region = if w.to_notify { &mut d.notify } else { &mut d.recv };
            region[w.dst_off as usize..w.dst_off as usize + bytes.len()].copy_from_slice(&bytes);
            match layout.imm.decode(w.imm).unwrap() {
                NormalMsg::Data { phase: p, src, slot, rows } => {
                    assert_eq!(p, phase);
                    assert_eq!(src as usize, w.src);
                    let cell = &mut d.filled[(src * spp + slot) as usize];
                    assert!(cell.is_none(), "slot overwritten before it was consumed");
                    *cell = Some(rows);
                }
                NormalMsg::Notify { src, .. } => {
                    assert!(!d.notified[src as usize]);
                    d.notified[src as usize] = true;
                    let off = layout.notify_offset(src, 0).unwrap() as usize;
                    let rec =
                        NotifyRecord::decode(&d.notify[off..], layout.num_local_experts).unwrap();
                    d.expect[src as usize] = Some(rec.num_tokens as u64);
                }
                NormalMsg::Credit { src, chunks } => {
                    assert!(d.uncredited[src as usize] >= chunks);
                    d.uncredited[src as usize] -= chunks;
                }
            }
        }
        let mut notifies = vec![Vec::new(); n];
        for (me, r) in ranks.iter().enumerate() {
            for src in 0..n {
                assert_eq!(r.consume_k[src], layout.num_chunks(r.got[src].len() as u64));
                assert_eq!(r.uncredited[src], 0, "rank {me}: credits outstanding to {src}");
                if notify.is_some() {
                    let off = layout.notify_offset(src as u64, 0).unwrap() as usize;
                    notifies[me].push(
                        NotifyRecord::decode(&r.notify[off..], layout.num_local_experts).unwrap(),
                    );
                }
            }
        }
        (ranks.into_iter().map(|r| r.got).collect(), notifies)
    }

    /// `[t, R]` as the layout step would produce it (private; layout.rs is elsewhere).
    fn is_token_in_rank(topk: &[i64], t: usize, k: usize, r: usize, l: usize) -> Vec<bool> {
        let mut v = vec![false; t * r];
        for i in 0..t {
            for &g in &topk[i * k..(i + 1) * k] {
                if g >= 0 {
                    v[i * r + g as usize / l] = true;
                }
            }
        }
        v
    }

    #[allow(clippy::too_many_arguments)]
    fn normal_protocol_matches_reference(
        seed: u64,
        r: usize,
        e: usize,
        k: usize,
        h: usize,
        tokens: &[usize],
        fp8: bool,
        chunk: u64,
        spp: u64,
    ) {
        let mut rng = SplitMix64(seed);
        let l = e / r;
        let groups = h / 128;
        let dtype = if fp8 { FP8 } else { BF16 };
        let layout =
            NormalLayout::from_parts(r as u64, e as u64, h as u64, k as u64, dtype, chunk, spp)
                .unwrap();
        let xs: Vec<Vec<u16>> = tokens.iter().map(|&t| random_bf16(&mut rng, t * h)).collect();
        let q: Vec<(Vec<u8>, Vec<f32>)> = xs
            .iter()
            .map(|x| {
                if fp8 {
                    crate::protocol::quant::quantize_bf16(x, h, false).unwrap()
                } else {
                    (vec![], vec![])
                }
            })
            .collect();
        let idxs: Vec<Vec<i64>> =
            tokens.iter().map(|&t| random_topk(&mut rng, t, k, e, 0.15)).collect();
        let ws: Vec<Vec<f32>> =
            tokens.iter().map(|&t| (0..t * k).map(|_| rng.unit_f32()).collect()).collect();

        // Sender side: send plans, notify records and the encoded record streams.
        let plans: Vec<SendPlan> = (0..r)
            .map(|s| {
                let itr = is_token_in_rank(&idxs[s], tokens[s], k, r, l);
                SendPlan::from_is_token_in_rank(&itr, tokens[s] as u64, r as u64).unwrap()
            })
            .collect();
        let mut notify = Vec::new();
        let mut streams = Vec::new();
        for s in 0..r {
            let per_rank: Vec<u32> =
                (0..r).map(|d| plans[s].tokens_for(d as u64).len() as u32).collect();
            let mut per_expert = vec![0u32; e];
            for &g in idxs[s].iter().filter(|&&g| g >= 0) {
                per_expert[g as usize] += 1;
            }
            notify.push(
                (0..r as u64)
                    .map(|d| NotifyRecord::for_destination(d, 0, &per_rank, &per_expert).unwrap())
                    .collect(),
            );
            let rec = layout.dispatch_record;
            let (mut li, mut lw) = (vec![0i32; k], vec![0f32; k]);
            let mut payload = vec![0u8; rec.payload_bytes as usize];
            let row: Vec<Vec<Vec<u8>>> = (0..r as u64)
                .map(|d| {
                    plans[s]
                        .tokens_for(d)
                        .iter()
                        .map(|&t| {
                            let t = t as usize;
                            to_local_topk(
                                &idxs[s][t * k..(t + 1) * k],
                                &ws[s][t * k..(t + 1) * k],
                                d,
                                l as u64,
                                &mut li,
                                &mut lw,
                            )
                            .unwrap();
                            let scales: &[f32] = if fp8 {
                                payload.copy_from_slice(&q[s].0[t * h..(t + 1) * h]);
                                &q[s].1[t * groups..(t + 1) * groups]
                            } else {
                                for (c, &b) in xs[s][t * h..(t + 1) * h].iter().enumerate() {
                                    payload[2 * c..2 * c + 2].copy_from_slice(&b.to_le_bytes());
                                }
                                &[]
                            };
                            let mut out = vec![0u8; rec.bytes as usize];
                            let f = RecordFields {
                                payload: &payload,
                                scales,
                                topk_idx: &li,
                                topk_weights: &lw,
                                src_idx: t as i32,
                            };
                            rec.write(&mut out, &f).unwrap();
                            out
                        })
                        .collect()
                })
                .collect();
            streams.push(row);
        }
        let (got, notifies) = run_queues(&layout, Phase::Dispatch, streams, Some(notify), &mut rng);

        // Reference.
        let inputs: Vec<refm::NormalRankInput> = (0..r)
            .map(|s| refm::NormalRankInput {
                x: if fp8 {
                    TokensRef::Fp8 { x: &q[s].0, scales: &q[s].1 }
                } else {
                    TokensRef::Bf16(&xs[s])
                },
                topk_idx: &idxs[s],
                topk_weights: &ws[s],
            })
            .collect();
        let p = refm::NormalParams {
            num_experts: e,
            hidden: h,
            num_topk: k,
            expert_alignment: 4,
            num_worst_tokens: None,
        };
        let want = refm::normal_dispatch(&p, &inputs).unwrap();

        // Receiver side: the plan from the notifies, then records -> outputs.
        let mut recv_x_all = Vec::new();
        for d in 0..r {
            let plan = RecvPlan::new(d, &notifies[d], &layout, 4, None).unwrap();
            let w = &want[d];
            assert_eq!(
                plan.rank_prefix.iter().map(|&v| v as usize).collect::<Vec<_>>(),
                w.rank_prefix
            );
            assert_eq!(
                plan.tokens_per_local_expert.iter().map(|&v| v as usize).collect::<Vec<_>>(),
                w.num_recv_tokens_per_expert
            );
            let rows = plan.num_out_rows as usize;
            let (mut xb, mut x8, mut sc) =
                (vec![0u16; rows * h], vec![0u8; rows * h], vec![0f32; rows * groups]);
            let (mut ti, mut tw) = (vec![-1i64; rows * k], vec![0f32; rows * k]);
            let (mut sr, mut si) = (vec![0i32; rows], vec![0i32; rows]);
            for s in 0..r {
                for (i, recb) in got[d][s].iter().enumerate() {
                    let (kk, row) = (i as u64 / chunk, i as u64 % chunk);
                    let o = plan.out_row(&layout, s as u64, kk, row).unwrap() as usize;
                    let v = layout.dispatch_record.read(recb).unwrap();
                    if fp8 {
                        x8[o * h..(o + 1) * h].copy_from_slice(v.payload());
                        for g in 0..groups {
                            sc[o * groups + g] = v.scale(g as u64).unwrap();
                        }
                    } else {
                        for c in 0..h {
                            xb[o * h + c] =
                                u16::from_le_bytes([v.payload()[2 * c], v.payload()[2 * c + 1]]);
                        }
                    }
                    for j in 0..k {
                        ti[o * k + j] = v.topk_idx(j as u64).unwrap() as i64;
                        tw[o * k + j] = v.topk_weight(j as u64).unwrap();
                    }
                    sr[o] = s as i32;
                    si[o] = v.src_idx().unwrap();
                }
            }
            let recv_x =
                if fp8 { Tokens::Fp8 { x: x8, scales: sc } } else { Tokens::Bf16(xb.clone()) };
            assert_eq!(recv_x, w.recv_x, "rank {d} recv_x");
            assert_eq!(ti, w.recv_topk_idx, "rank {d} recv_topk_idx");
            assert_eq!(tw, w.recv_topk_weights, "rank {d} recv_topk_weights");
            assert_eq!((sr, si), (w.recv_src_rank.clone(), w.recv_src_idx.clone()));
            recv_x_all.push(xb);
        }
        if fp8 {
            return;
        }

        // Combine through the same queues, reversed: rank d returns row o scaled by (d + 1).
        let ys: Vec<Vec<u16>> = recv_x_all
            .iter()
            .enumerate()
            .map(|(d, x)| {
                x.iter().map(|&b| f32_to_bf16(bf16_to_f32(b) * (d as f32 + 1.0))).collect()
            })
            .collect();
        let crec = layout.combine_record;
        let mut streams = vec![vec![Vec::new(); r]; r];
        for d in 0..r {
            let w = &want[d];
            for s in 0..r {
                for o in w.rank_prefix[s]..w.rank_prefix[s + 1] {
                    let payload: Vec<u8> =
                        ys[d][o * h..(o + 1) * h].iter().flat_map(|b| b.to_le_bytes()).collect();
                    let mut out = vec![0u8; crec.bytes as usize];
                    let f = RecordFields {
                        payload: &payload,
                        scales: &[],
                        topk_idx: &[],
                        topk_weights: &w.recv_topk_weights[o * k..(o + 1) * k],
                        src_idx: 0,
                    };
                    crec.write(&mut out, &f).unwrap();
                    streams[d][s].push(out);
                }
            }
        }
        let (got, _) = run_queues(&layout, Phase::Combine, streams, None, &mut rng);
        let cin: Vec<refm::NormalCombineInput> = (0..r)
            .map(|d| refm::NormalCombineInput {
                x: &ys[d],
                topk_weights: Some(&want[d].recv_topk_weights),
            })
            .collect();
        let cwant = refm::normal_combine(&p, &want, &cin).unwrap();
        for s in 0..r {
            // Contributions kept per source rank and summed in ascending rank order.
            let mut acc = vec![0f32; tokens[s] * h];
            let mut accw = vec![0f32; tokens[s] * k];
            for d in 0..r {
                let toks = plans[s].tokens_for(d as u64);
                assert_eq!(got[s][d].len(), toks.len());
                for (i, recb) in got[s][d].iter().enumerate() {
                    let v = crec.read(recb).unwrap();
                    let t = toks[i] as usize;
                    for c in 0..h {
                        acc[t * h + c] += bf16_to_f32(u16::from_le_bytes([
                            v.payload()[2 * c],
                            v.payload()[2 * c + 1],
                        ]));
                    }
                    for j in 0..k {
                        accw[t * k + j] += v.topk_weight(j as u64).unwrap();
                    }
                }
            }
            let cx: Vec<u16> = acc.into_iter().map(f32_to_bf16).collect();
            assert_eq!(cx, cwant[s].combined_x, "rank {s} combined_x");
            assert_eq!(Some(accw), cwant[s].combined_topk_weights, "rank {s} combined weights");
        }
    }

    #[test]
    fn normal_protocol_over_unordered_delivery_matches_reference() {
        normal_protocol_matches_reference(1, 4, 16, 4, 32, &[37, 50, 0, 13], false, 5, 2);
        normal_protocol_matches_reference(2, 4, 8, 2, 256, &[20, 3, 9, 0], true, 4, 1);
        normal_protocol_matches_reference(3, 1, 4, 2, 16, &[25], false, 7, 3);
        normal_protocol_matches_reference(4, 3, 6, 6, 8, &[11, 0, 5], false, 1, 1); // all experts
        normal_protocol_matches_reference(5, 8, 32, 3, 8, &[9, 1, 0, 0, 30, 2, 7, 4], false, 3, 4);
        normal_protocol_matches_reference(6, 2, 2, 1, 16, &[0, 0], false, 2, 2);
        // nothing at all
    }

    // -----------------------------------------------------------------------------------------
    // The low-latency protocol through plan/, unordered, against the reference.
    // -----------------------------------------------------------------------------------------

    fn ll_protocol_matches_reference(
        seed: u64,
        e: usize,
        k: usize,
        h: usize,
        m: usize,
        tokens: &[usize],
        fp8: bool,
    ) {
        let r = tokens.len();
        let l = e / r;
        let mut rng = SplitMix64(seed);
        let layout = LlLayout::from_parts(
            r as u64,
            e as u64,
            h as u64,
            if fp8 { FP8 } else { BF16 },
            m as u64,
        )
        .unwrap();
        let xs: Vec<Vec<u16>> = tokens.iter().map(|&t| random_bf16(&mut rng, t * h)).collect();
        let idxs: Vec<Vec<i64>> =
            tokens.iter().map(|&t| random_topk(&mut rng, t, k, e, 0.2)).collect();
        let ws: Vec<Vec<f32>> =
            tokens.iter().map(|&t| (0..t * k).map(|_| rng.unit_f32() - 0.3).collect()).collect();
        let mut bufs: Vec<Vec<u8>> =
            (0..r).map(|_| vec![0u8; layout.total_bytes() as usize]).collect();
        let plans: Vec<LlSendPlan> = (0..r)
            .map(|s| LlSendPlan::new(&idxs[s], tokens[s] as u64, k as u64, &layout).unwrap())
            .collect();
        let (dset, cset) = (0u64, 1u64);
        let rec = layout.dispatch_record;
        let groups = h / 128;

        // Dispatch: pack rows at (g, pos), then one write per (dst, local expert).
        let mut pool = Vec::new();
        for s in 0..r {
            let mut payload = vec![0u8; rec.payload_bytes as usize];
            let mut scales = vec![0f32; if fp8 { groups } else { 0 }];
            for t in 0..tokens[s] {
                let row = &xs[s][t * h..(t + 1) * h];
                if fp8 {
                    quantize_row_bf16(row, false, &mut payload, &mut scales).unwrap();
                } else {
                    payload = row.iter().flat_map(|b| b.to_le_bytes()).collect();
                }
                for j in 0..k {
                    let g = idxs[s][t * k + j];
                    if g < 0 {
                        assert_eq!(plans[s].pos[t * k + j], -1);
                        continue;
                    }
                    let at = layout.dispatch_send_offset(dset, g as u64).unwrap()
                        + plans[s].pos[t * k + j] as u64 * rec.bytes;
                    let f = RecordFields {
                        payload: &payload,
                        scales: &scales,
                        topk_idx: &[],
                        topk_weights: &[],
                        src_idx: t as i32,
                    };
                    rec.write(&mut bufs[s][at as usize..], &f).unwrap();
                }
            }
            for g in 0..e as u64 {
                let (dst, le) = (g / l as u64, g % l as u64);
                let count = plans[s].count_per_expert[g as usize] as u64;
                assert_eq!(plans[s].counts_for(dst, &layout)[le as usize] as u64, count);
                pool.push((
                    s,
                    dst as usize,
                    layout.dispatch_send_offset(dset, g).unwrap(),
                    layout.dispatch_msg_bytes(count),
                    layout.dispatch_recv_offset(dset, le, s as u64).unwrap(),
                    layout.imm.dispatch(dset, le, s as u64, count).unwrap(),
                ));
            }
        }
        let mut counts = vec![vec![u32::MAX; l * r]; r];
        let mut arrivals = vec![0usize; r];
        while !pool.is_empty() {
            let (src, dst, from, len, to, imm) =
                pool.swap_remove(rng.below(pool.len() as u64) as usize);
            let bytes = bufs[src][from as usize..(from + len) as usize].to_vec();
            bufs[dst][to as usize..(to + len) as usize].copy_from_slice(&bytes);
            let LlMsg::Dispatch { set, local_expert, src: s, count } =
                layout.imm.decode(imm).unwrap()
            else {
                panic!()
            };
            assert_eq!((set, s as usize), (dset, src));
            assert_eq!(counts[dst][local_expert as usize * r + src], u32::MAX, "duplicate message");
            counts[dst][local_expert as usize * r + src] = count as u32;
            arrivals[dst] += 1;
        }
        assert!(arrivals.iter().all(|&a| a == e), "every rank gets exactly E messages");

        let p = refm::LlParams {
            num_experts: e,
            hidden: h,
            num_topk: k,
            max_tokens_per_rank: m,
            use_fp8: fp8,
            round_scale: false,
        };
        let inputs: Vec<refm::LlRankInput> =
            (0..r).map(|s| refm::LlRankInput { x: &xs[s], topk_idx: &idxs[s] }).collect();
        let want = refm::ll_dispatch(&p, &inputs).unwrap();
        let srows = r * m;
        let mut ys = Vec::new();
        let mut layouts = Vec::new();
        for d in 0..r {
            let lay = LlRecvLayout::new(d, &counts[d], &layout).unwrap();
            assert_eq!(lay.count_per_expert, want[d].recv_count);
            for le in 0..l {
                for s in 0..r {
                    assert_eq!(lay.range(le, s, r), Some(want[d].layout_range[le * r + s]));
                }
            }
            let (mut xb, mut x8, mut sc) = (
                vec![0u16; l * srows * h],
                vec![0u8; l * srows * h],
                vec![0f32; l * srows * groups],
            );
            let (mut sr, mut si) = (vec![-1i32; l * srows], vec![-1i32; l * srows]);
            for le in 0..l {
                for s in 0..r {
                    let (begin, count) = lay.range(le, s, r).unwrap();
                    let base = layout.dispatch_recv_offset(dset, le as u64, s as u64).unwrap();
                    for i in 0..count as u64 {
                        let o = le * srows + (begin as u64 + i) as usize;
                        let at = (base + i * rec.bytes) as usize;
                        let v = rec.read(&bufs[d][at..]).unwrap();
                        if fp8 {
                            x8[o * h..(o + 1) * h].copy_from_slice(v.payload());
                            for g in 0..groups {
                                sc[o * groups + g] = v.scale(g as u64).unwrap();
                            }
                        } else {
                            for c in 0..h {
                                xb[o * h + c] = u16::from_le_bytes([
                                    v.payload()[2 * c],
                                    v.payload()[2 * c + 1],
                                ]);
                            }
                        }
                        sr[o] = s as i32;
                        si[o] = v.src_idx().unwrap();
                    }
                }
            }
            let got =
                if fp8 { Tokens::Fp8 { x: x8, scales: sc } } else { Tokens::Bf16(xb.clone()) };
            assert_eq!(got, want[d].recv_x, "rank {d} recv_x");
            assert_eq!(sr, want[d].recv_src_rank);
            assert_eq!(si, want[d].recv_src_idx);
            // Expert "computation": scale each local expert's rows differently.
            ys.push(
                want[d]
                    .recv_x
                    .clone()
                    .bf16_or(&xb)
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| {
                        f32_to_bf16(bf16_to_f32(b) * (1.0 + (i / (srows * h)) as f32 * 0.5))
                    })
                    .collect::<Vec<u16>>(),
            );
            layouts.push(lay);
        }
        if fp8 {
            return;
        }

        // Combine: one write per (source rank, local expert), back to combine_recv[g].
        let crec = layout.combine_record;
        let mut pool = Vec::new();
        for d in 0..r {
            for le in 0..l {
                for s in 0..r {
                    let (begin, count) = layouts[d].range(le, s, r).unwrap();
                    let at = layout.combine_send_offset(cset, le as u64, s as u64).unwrap();
                    for i in 0..count as usize {
                        let o = le * srows + begin as usize + i;
                        let payload: Vec<u8> = ys[d][o * h..(o + 1) * h]
                            .iter()
                            .flat_map(|b| b.to_le_bytes())
                            .collect();
                        let f = RecordFields {
                            payload: &payload,
                            scales: &[],
                            topk_idx: &[],
                            topk_weights: &[],
                            src_idx: 0,
                        };
                        crec.write(&mut bufs[d][(at + i as u64 * crec.bytes) as usize..], &f)
                            .unwrap();
                    }
                    let g = (d * l + le) as u64;
                    pool.push((
                        d,
                        s,
                        at,
                        layout.combine_msg_bytes(count as u64),
                        layout.combine_recv_offset(cset, g).unwrap(),
                        layout.imm.combine(cset, d as u64, le as u64, count as u64).unwrap(),
                    ));
                }
            }
        }
        let mut arrivals = vec![0usize; r];
        while !pool.is_empty() {
            let (src, dst, from, len, to, imm) =
                pool.swap_remove(rng.below(pool.len() as u64) as usize);
            let bytes = bufs[src][from as usize..(from + len) as usize].to_vec();
            bufs[dst][to as usize..(to + len) as usize].copy_from_slice(&bytes);
            let LlMsg::Combine { set, src: s, local_expert, count } =
                layout.imm.decode(imm).unwrap()
            else {
                panic!()
            };
            assert_eq!((set, s as usize), (cset, src));
            assert_eq!(
                count,
                plans[dst].count_per_expert[s as usize * l + local_expert as usize] as u64
            );
            arrivals[dst] += 1;
        }
        assert!(arrivals.iter().all(|&a| a == e));
        let cin: Vec<refm::LlCombineInput> = (0..r)
            .map(|d| refm::LlCombineInput { x: &ys[d], topk_idx: &idxs[d], topk_weights: &ws[d] })
            .collect();
        let cwant = refm::ll_combine(&p, &want, &cin).unwrap();
        for s in 0..r {
            let mut out = vec![0u16; tokens[s] * h];
            for t in 0..tokens[s] {
                let mut acc = vec![0f32; h];
                for j in 0..k {
                    let g = idxs[s][t * k + j];
                    if g < 0 {
                        continue;
                    }
                    let at = layout.combine_recv_offset(cset, g as u64).unwrap()
                        + plans[s].pos[t * k + j] as u64 * crec.bytes;
                    let v = crec.read(&bufs[s][at as usize..]).unwrap();
                    for c in 0..h {
                        let y = bf16_to_f32(u16::from_le_bytes([
                            v.payload()[2 * c],
                            v.payload()[2 * c + 1],
                        ]));
                        acc[c] = y.mul_add(ws[s][t * k + j], acc[c]);
                    }
                }
                for c in 0..h {
                    out[t * h + c] = f32_to_bf16(acc[c]);
                }
            }
            assert_eq!(out, cwant[s], "rank {s} combined");
        }
    }

    trait Bf16Or {
        fn bf16_or<'a>(&'a self, fallback: &'a [u16]) -> &'a [u16];
    }
    impl Bf16Or for Tokens {
        fn bf16_or<'a>(&'a self, fallback: &'a [u16]) -> &'a [u16] {
            match self {
                Tokens::Bf16(x) => x,
                Tokens::Fp8 { .. } => fallback,
            }
        }
    }

    #[test]
    fn ll_protocol_over_unordered_delivery_matches_reference() {
        ll_protocol_matches_reference(1, 16, 4, 32, 8, &[7, 0, 8, 3], false);
        ll_protocol_matches_reference(2, 8, 3, 256, 6, &[6, 2], true);
        ll_protocol_matches_reference(3, 4, 4, 16, 5, &[5, 5, 5, 5], false); // every expert
        ll_protocol_matches_reference(4, 3, 1, 8, 4, &[0, 0, 0], false);
        ll_protocol_matches_reference(5, 6, 2, 8, 9, &[9], false);
    }

    #[test]
    fn ll_plans_bound_their_inputs() {
        let layout = LlLayout::from_parts(2, 4, 8, BF16, 3).unwrap();
        let e = LlSendPlan::new(&[0; 4], 4, 1, &layout);
        assert!(matches!(e, Err(Error::InvalidArgument { arg: "x", .. })));
        let e = LlSendPlan::new(&[1, 1], 1, 2, &layout);
        assert!(matches!(e, Err(Error::InvalidArgument { arg: "topk_idx", .. })));
        let e = LlSendPlan::new(&[4], 1, 1, &layout);
        assert!(matches!(e, Err(Error::InvalidArgument { arg: "topk_idx", .. })));
        // All tokens to one expert: pos counts up, the block holds them.
        let p = LlSendPlan::new(&[2, -1, 2, 0, 2, -1], 3, 2, &layout).unwrap();
        assert_eq!(p.count_per_expert, vec![1, 0, 3, 0]);
        assert_eq!(p.pos, vec![0, -1, 1, 0, 2, -1]);
        let e = LlRecvLayout::new(1, &[0, 4, 0, 0], &layout);
        assert!(matches!(e, Err(Error::Protocol { rank: 1, peer: 1, .. })));
        assert!(LlRecvLayout::new(1, &[0, 3], &layout).is_err());
        let ll = LlRecvLayout::new(0, &[3, 3, 0, 1], &layout).unwrap();
        assert_eq!((ll.begin, ll.count_per_expert), (vec![0, 3, 0, 0], vec![6, 1]));
        // Offsets: sets and areas do not overlap, units tile the buffer.
        let mut seen = std::collections::HashSet::new();
        for set in 0..2 {
            for g in 0..4 {
                assert!(seen.insert(layout.dispatch_send_offset(set, g).unwrap()));
                assert!(seen.insert(layout.combine_recv_offset(set, g).unwrap()));
            }
        }
        assert_eq!(seen.len() as u64 * layout.unit_bytes, layout.total_bytes());
        assert_eq!(
            layout.combine_send_offset(1, 1, 0).unwrap(),
            layout.dispatch_send_offset(1, 2).unwrap()
        );
        assert!(layout.dispatch_recv_offset(0, 2, 0).is_err());
    }

    #[test]
    fn cluster_sizing_scales_to_thousands_of_ranks() {
        // Exact miss probability by enumeration: E = 4, L = 2, K = 2 -> P(hit) = 5/6.
        let small = ClusterParams {
            num_ranks: 2,
            num_experts: 4,
            hidden: 128,
            num_topk: 2,
            dtype: FP8,
            num_tokens: 600,
            max_tokens_per_rank: 10,
            chunk_tokens: 64,
            slots_per_peer: 2,
            max_region_bytes: 1 << 30,
        };
        let s = cluster_sizing(&small).unwrap();
        assert!((s.p_token_to_rank - 5.0 / 6.0).abs() < 1e-12);
        assert!((s.normal_tokens_per_peer_expected - 500.0).abs() < 1e-9);
        assert_eq!(s.normal_dispatch_msgs_max, 2 + 2 * 10);
        assert_eq!(s.normal_dispatch_msgs_expected, 2 + 2 * 8);
        assert_eq!(s.ll_msgs, 4);
        for ranks in [8u64, 256, 1024, 4096] {
            let p = ClusterParams {
                num_ranks: ranks,
                num_experts: ranks.max(256),
                hidden: 7168,
                num_topk: 8,
                dtype: FP8,
                num_tokens: 4096,
                max_tokens_per_rank: 128,
                chunk_tokens: 32,
                slots_per_peer: 2,
                max_region_bytes: 1 << 32,
            };
            let s = cluster_sizing(&p).unwrap();
            let normal =
                NormalLayout::from_parts(ranks, p.num_experts, 7168, 8, FP8, 32, 2).unwrap();
            assert_eq!(s.normal_recv_bytes, ranks * 2 * normal.slot_bytes);
            assert_eq!(
                s.normal_total_bytes,
                s.normal_recv_bytes + s.normal_send_bytes + s.normal_notify_bytes
            );
            assert!(s.normal_regions >= s.normal_total_bytes.div_ceil(1 << 32));
            assert!(s.ll_regions >= s.ll_total_bytes.div_ceil(1 << 32));
            assert!(s.p_token_to_rank > 0.0 && s.p_token_to_rank <= 1.0);
            assert!(
                s.ll_dispatch_bytes_per_peer_max >= s.ll_dispatch_bytes_per_peer_expected as u64
            );
            if ranks >= 4096 {
                assert!(s.normal_total_bytes > i32::MAX as u64);
            }
        }
        let bad =
            ClusterParams { slots_per_peer: 200, num_ranks: 1024, num_experts: 1024, ..small };
        assert!(matches!(
            cluster_sizing(&bad),
            Err(Error::InvalidArgument { arg: "slots_per_peer", .. })
        ));
    }
}
