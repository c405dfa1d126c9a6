//! The EP configuration: every setting in one struct, validated once, with size hints.
//!
//! Build an [`EpSettings`] (plain public fields, sensible defaults from [`EpSettings::new`]),
//! then [`EpConfig::new`] validates it and precomputes the buffer layouts. An `EpConfig`
//! therefore always holds valid settings; its size hints are infallible and in `u64` bytes
//! (DeepEP's `int` sizes overflowed past 1024 ranks).
//!
//! ```
//! use fabric_ep::protocol::config::{EpConfig, EpSettings, DispatchDtype};
//! let cfg = EpConfig::new(EpSettings {
//!     dispatch_dtype: DispatchDtype::Fp8E4m3,
//!     ..EpSettings::new(0, 16, 256, 7168, 8)
//! })
//! .unwrap();
//! assert_eq!(cfg.num_local_experts(), 16);
//! assert!(cfg.ll_buffer_bytes() > 0);
//! ```

use std::ops::Deref;
use std::time::Duration;

// Defined beside the layouts that size with it (plan/ uses it; config.rs uses plan/).
pub use super::dtype::DispatchDtype;
use super::plan::{self, LlLayout, NormalLayout};
use crate::{Error, Result};

/// Version of the wire protocol and buffer layouts; part of [`EpConfig::hash`], so ranks built
/// from incompatible sources fail at connect. Bump on any change to plan/'s layouts.
pub const PROTOCOL_VERSION: u64 = 1;

/// Every setting, as plain fields. Validate with [`EpConfig::new`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpSettings {
    /// This process's rank, `0..num_ranks`.
    pub rank: usize,
    /// World size.
    pub num_ranks: usize,
    /// Ranks per node (intranode peers); divides `num_ranks`.
    pub ranks_per_node: usize,
    /// Global experts; a multiple of `num_ranks` (expert `g` lives on rank `g / local_experts`).
    pub num_experts: usize,
    /// Channels per token: a multiple of 8 (16-byte bf16 rows), and of 128 for fp8.
    pub hidden: usize,
    /// Experts per token, `1..=num_experts`.
    pub num_topk: usize,
    /// Low-latency mode: most tokens any rank passes to one call, `1..=16383`.
    pub max_tokens_per_rank: usize,
    /// Dispatch format the buffers are sized for.
    pub dispatch_dtype: DispatchDtype,
    /// Normal mode: tokens per chunk (one RMA write), `1..=16383`.
    pub chunk_tokens: usize,
    /// Normal mode: chunk slots per (source rank, destination rank) queue, `>= 1`.
    pub slots_per_peer: usize,
    /// SM budget for the kernels of one call.
    pub num_sms: usize,
    /// Bound on every wait.
    pub timeout: Duration,
}

/// Default normal-mode chunk size, tokens.
pub const DEFAULT_CHUNK_TOKENS: usize = 64;
/// Default slots per peer queue (4 chunks in flight per peer).
pub const DEFAULT_SLOTS_PER_PEER: usize = 4;
/// Default low-latency capacity, tokens per rank.
pub const DEFAULT_MAX_TOKENS_PER_RANK: usize = 128;
/// Default SM budget (DeepEP's default dispatch config uses 20).
pub const DEFAULT_NUM_SMS: usize = 20;
/// Default bound on every wait.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest ranks per node [`EpSettings::new`] picks by default (NVLink domain of one node).
pub const DEFAULT_MAX_RANKS_PER_NODE: usize = 8;

impl EpSettings {
    /// The required settings plus defaults: bf16, `ranks_per_node` the largest divisor of
    /// `num_ranks` not above 8, and the `DEFAULT_*` constants.
    pub fn new(
        rank: usize,
        num_ranks: usize,
        num_experts: usize,
        hidden: usize,
        num_topk: usize,
    ) -> Self {
        let ranks_per_node = (1..=DEFAULT_MAX_RANKS_PER_NODE.min(num_ranks.max(1)))
            .rev()
            .find(|d| num_ranks % d == 0)
            .unwrap_or(1);
        EpSettings {
            rank,
            num_ranks,
            ranks_per_node,
            num_experts,
            hidden,
            num_topk,
            max_tokens_per_rank: DEFAULT_MAX_TOKENS_PER_RANK,
            dispatch_dtype: DispatchDtype::Bf16,
            chunk_tokens: DEFAULT_CHUNK_TOKENS,
            slots_per_peer: DEFAULT_SLOTS_PER_PEER,
            num_sms: DEFAULT_NUM_SMS,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Check every invariant; the error names the first field that is wrong.
    pub fn validate(&self) -> Result<()> {
        let s = self;
        if s.num_ranks == 0 {
            return Err(Error::arg("num_ranks", "must be at least 1"));
        }
        if s.rank >= s.num_ranks {
            return Err(Error::arg("rank", format!("{} not in 0..{}", s.rank, s.num_ranks)));
        }
        if s.ranks_per_node == 0 || s.num_ranks % s.ranks_per_node != 0 {
            return Err(Error::arg(
                "ranks_per_node",
                format!("{} does not divide num_ranks {}", s.ranks_per_node, s.num_ranks),
            ));
        }
        if s.num_experts == 0 || s.num_experts % s.num_ranks != 0 {
            return Err(Error::arg(
                "num_experts",
                format!(
                    "{} is not a positive multiple of num_ranks {}",
                    s.num_experts, s.num_ranks
                ),
            ));
        }
        if s.num_topk == 0 || s.num_topk > s.num_experts || s.num_topk > plan::MAX_TOPK {
            return Err(Error::arg(
                "num_topk",
                format!("{} not in 1..={}", s.num_topk, s.num_experts.min(plan::MAX_TOPK)),
            ));
        }
        plan::check_hidden(s.hidden, s.dispatch_dtype)?;
        let vmax = plan::IMM_VALUE_MAX as usize;
        if s.max_tokens_per_rank == 0 || s.max_tokens_per_rank > vmax {
            return Err(Error::arg(
                "max_tokens_per_rank",
                format!(
                    "{} not in 1..={vmax} (the count travels in 14 bits)",
                    s.max_tokens_per_rank
                ),
            ));
        }
        if s.chunk_tokens == 0 || s.chunk_tokens > vmax {
            return Err(Error::arg(
                "chunk_tokens",
                format!("{} not in 1..={vmax} (the count travels in 14 bits)", s.chunk_tokens),
            ));
        }
        if s.slots_per_peer == 0 {
            return Err(Error::arg("slots_per_peer", "must be at least 1"));
        }
        if s.num_sms == 0 {
            return Err(Error::arg("num_sms", "must be at least 1"));
        }
        if s.timeout.is_zero() {
            return Err(Error::arg("timeout", "must be positive"));
        }
        // The id spaces of both modes' immediate data (errors name slots_per_peer / num_experts).
        plan::NormalImm::new(s.num_ranks as u64, s.slots_per_peer as u64)?;
        plan::LlImm::new(s.num_ranks as u64, s.num_experts as u64)?;
        Ok(())
    }
}

/// Validated settings plus the layouts derived from them. Reads through to [`EpSettings`]
/// (`cfg.hidden`); cannot be mutated, so it stays valid.
#[derive(Clone, Debug)]
pub struct EpConfig {
    settings: EpSettings,
    normal: NormalLayout,
    ll: LlLayout,
}

impl Deref for EpConfig {
    type Target = EpSettings;
    fn deref(&self) -> &EpSettings {
        &self.settings
    }
}

impl EpConfig {
    /// Validate `settings` (errors name the field) and compute the buffer layouts.
    pub fn new(settings: EpSettings) -> Result<Self> {
        settings.validate()?;
        let s = &settings;
        let normal = NormalLayout::from_parts(
            s.num_ranks as u64,
            s.num_experts as u64,
            s.hidden as u64,
            s.num_topk as u64,
            s.dispatch_dtype,
            s.chunk_tokens as u64,
            s.slots_per_peer as u64,
        )?;
        let ll = LlLayout::from_parts(
            s.num_ranks as u64,
            s.num_experts as u64,
            s.hidden as u64,
            s.dispatch_dtype,
            s.max_tokens_per_rank as u64,
        )?;
        Ok(EpConfig { settings, normal, ll })
    }

    /// The settings this config was built from.
    pub fn settings(&self) -> &EpSettings {
        &self.settings
    }

    /// Experts per rank.
    pub fn num_local_experts(&self) -> usize {
        self.num_experts / self.num_ranks
    }

    /// Number of nodes (`num_ranks / ranks_per_node`).
    pub fn num_nodes(&self) -> usize {
        self.num_ranks / self.ranks_per_node
    }

    /// Node of `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.ranks_per_node
    }

    /// Normal-mode buffer layout (record sizes, slots, immediate data).
    pub fn normal_layout(&self) -> &NormalLayout {
        &self.normal
    }

    /// Low-latency buffer layout.
    pub fn ll_layout(&self) -> &LlLayout {
        &self.ll
    }

    /// Normal mode: bytes of this rank's receive region (every source's slots).
    pub fn normal_recv_bytes(&self) -> u64 {
        self.normal.recv_bytes()
    }

    /// Normal mode: bytes of this rank's send staging (every destination's slots).
    pub fn normal_send_bytes(&self) -> u64 {
        self.normal.send_bytes()
    }

    /// Normal mode: bytes of the notify region (two record slots per source).
    pub fn normal_notify_bytes(&self) -> u64 {
        self.normal.notify_bytes()
    }

    /// Low-latency mode: bytes of the buffer, both alternating sets, send and receive areas.
    pub fn ll_buffer_bytes(&self) -> u64 {
        self.ll.total_bytes()
    }

    /// Memory regions the normal-mode buffers need (receive + send + notify) when one region
    /// may be at most `max_region_bytes`; no slot is split across regions.
    pub fn normal_num_regions(&self, max_region_bytes: u64) -> Result<u64> {
        let data = self.normal.data_region_plan(max_region_bytes)?;
        let notify = self.normal.notify_region_plan(max_region_bytes)?;
        Ok(2 * data.num_regions + notify.num_regions)
    }

    /// Memory regions the low-latency buffer needs under `max_region_bytes`.
    pub fn ll_num_regions(&self, max_region_bytes: u64) -> Result<u64> {
        Ok(self.ll.region_plan(max_region_bytes)?.num_regions)
    }

    /// Stable 64-bit FNV-1a hash over [`PROTOCOL_VERSION`] and every setting that must agree
    /// across ranks (not `rank`, `num_sms` or `timeout`). Exchanged at connect.
    pub fn hash(&self) -> u64 {
        let s = &self.settings;
        let fields: [(u8, u64); 10] = [
            (1, PROTOCOL_VERSION),
            (2, s.num_ranks as u64),
            (3, s.ranks_per_node as u64),
            (4, s.num_experts as u64),
            (5, s.hidden as u64),
            (6, s.num_topk as u64),
            (7, s.max_tokens_per_rank as u64),
            (8, s.dispatch_dtype as u64),
            (9, s.chunk_tokens as u64),
            (10, s.slots_per_peer as u64),
        ];
        let mut h = FNV_OFFSET;
        for (tag, v) in fields {
            h = fnv1a(h, &[tag]);
            h = fnv1a(h, &v.to_le_bytes());
        }
        h
    }

    /// Compare this config's hash with a peer's; the error names the peer.
    pub fn check_peer_hash(&self, peer: usize, peer_hash: u64) -> Result<()> {
        let mine = self.hash();
        if mine == peer_hash {
            Ok(())
        } else {
            Err(Error::ConfigMismatch(format!(
                "rank {} has config hash {mine:#018x}, rank {peer} has {peer_hash:#018x} \
                 (ranks, ranks per node, experts, hidden, topk, max tokens, dtype, chunking \
                 and protocol version {PROTOCOL_VERSION} must match)",
                self.rank
            )))
        }
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> EpSettings {
        EpSettings::new(0, 16, 256, 7168, 8)
    }

    fn err_arg(s: EpSettings) -> &'static str {
        match EpConfig::new(s) {
            Err(Error::InvalidArgument { arg, .. }) => arg,
            other => panic!("expected an argument error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid() {
        let c = EpConfig::new(base()).unwrap();
        assert_eq!(c.ranks_per_node, 8);
        assert_eq!(c.num_nodes(), 2);
        assert_eq!(c.num_local_experts(), 16);
        assert_eq!(EpSettings::new(0, 12, 12, 128, 1).ranks_per_node, 6);
        assert_eq!(EpSettings::new(0, 7, 7, 128, 1).ranks_per_node, 7);
        assert_eq!(EpSettings::new(0, 1, 1, 128, 1).ranks_per_node, 1);
    }

    #[test]
    fn errors_name_the_field() {
        let mut s = base();
        s.rank = 16;
        assert_eq!(err_arg(s), "rank");
        let mut s = base();
        s.num_ranks = 0;
        assert_eq!(err_arg(s), "num_ranks");
        let mut s = base();
        s.ranks_per_node = 3;
        assert_eq!(err_arg(s), "ranks_per_node");
        let mut s = base();
        s.num_experts = 250;
        assert_eq!(err_arg(s), "num_experts");
        let mut s = base();
        s.num_topk = 0;
        assert_eq!(err_arg(s), "num_topk");
        let mut s = base();
        s.num_topk = 257;
        assert_eq!(err_arg(s), "num_topk");
        let mut s = base();
        s.hidden = 7164;
        assert_eq!(err_arg(s), "hidden");
        let mut s = base();
        s.hidden = 7176; // multiple of 8, not of 128
        assert!(EpConfig::new(s.clone()).is_ok());
        s.dispatch_dtype = DispatchDtype::Fp8E4m3;
        assert_eq!(err_arg(s), "hidden");
        let mut s = base();
        s.max_tokens_per_rank = 16384;
        assert_eq!(err_arg(s), "max_tokens_per_rank");
        let mut s = base();
        s.chunk_tokens = 0;
        assert_eq!(err_arg(s), "chunk_tokens");
        let mut s = base();
        s.slots_per_peer = 0;
        assert_eq!(err_arg(s), "slots_per_peer");
        let mut s = base();
        s.num_sms = 0;
        assert_eq!(err_arg(s), "num_sms");
        let mut s = base();
        s.timeout = Duration::ZERO;
        assert_eq!(err_arg(s), "timeout");
    }

    #[test]
    fn imm_id_space_limits_ranks_and_slots() {
        // 1024 ranks: 1024 * (2 * slots + 2) <= 2^18  <=>  slots <= 127.
        let mut s = EpSettings::new(0, 1024, 1024, 7168, 8);
        s.slots_per_peer = 127;
        assert!(EpConfig::new(s.clone()).is_ok());
        s.slots_per_peer = 128;
        assert_eq!(err_arg(s), "slots_per_peer");
        // Low latency: 4 * num_experts <= 2^18.
        let s = EpSettings::new(0, 1024, 65536, 1024, 8);
        assert!(EpConfig::new(s).is_ok());
        let s = EpSettings::new(0, 1024, 65536 + 1024, 1024, 8);
        assert_eq!(err_arg(s), "num_experts");
    }

    #[test]
    fn hash_is_stable_and_covers_shared_fields() {
        let a = EpConfig::new(base()).unwrap();
        // Golden value: changing it means the wire protocol changed; bump PROTOCOL_VERSION.
        assert_eq!(a.hash(), EpConfig::new(base()).unwrap().hash());
        let golden = a.hash();
        assert_eq!(golden, 0x2501_25e8_991a_04b2, "{golden:#x}");
        let local_only = EpConfig::new(EpSettings {
            rank: 5,
            num_sms: 7,
            timeout: Duration::from_secs(1),
            ..base()
        })
        .unwrap();
        assert_eq!(local_only.hash(), golden);
        let variants = [
            EpSettings { hidden: 4096, ..base() },
            EpSettings { num_topk: 6, ..base() },
            EpSettings { num_experts: 128, ..base() },
            EpSettings { ranks_per_node: 4, ..base() },
            EpSettings { max_tokens_per_rank: 256, ..base() },
            EpSettings { dispatch_dtype: DispatchDtype::Fp8E4m3, ..base() },
            EpSettings { chunk_tokens: 32, ..base() },
            EpSettings { slots_per_peer: 2, ..base() },
            EpSettings { num_ranks: 32, ..base() },
        ];
        for v in variants {
            let c = EpConfig::new(v.clone()).unwrap();
            assert_ne!(c.hash(), golden, "{v:?}");
            assert!(matches!(a.check_peer_hash(3, c.hash()), Err(Error::ConfigMismatch(_))));
        }
        assert!(a.check_peer_hash(3, golden).is_ok());
    }

    #[test]
    fn size_hints_are_u64_and_regions_split() {
        // 1024 ranks at defaults: far past i32.
        let c = EpConfig::new(EpSettings::new(0, 1024, 1024, 7168, 8)).unwrap();
        let slot = c.normal_layout().slot_bytes;
        assert_eq!(c.normal_recv_bytes(), 1024 * 4 * slot);
        assert!(c.normal_recv_bytes() > i32::MAX as u64);
        assert_eq!(c.normal_send_bytes(), c.normal_recv_bytes());
        let max_region = 1u64 << 30;
        let per = max_region / slot;
        let data_regions = (1024 * 4u64).div_ceil(per);
        assert_eq!(c.normal_num_regions(max_region).unwrap(), 2 * data_regions + 1);
        assert!(matches!(
            c.normal_num_regions(slot - 1),
            Err(Error::InvalidArgument { arg: "max_region_bytes", .. })
        ));
        let ll = c.ll_layout();
        assert_eq!(c.ll_buffer_bytes(), 2 * 2 * 1024 * ll.unit_bytes);
        assert!(c.ll_num_regions(max_region).unwrap() >= c.ll_buffer_bytes().div_ceil(max_region));
    }
}
