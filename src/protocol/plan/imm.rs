//! Immediate data: the one codec of an RMA write's 4-byte immediate ([`ImmCodec`]:
//! `slot << value_bits | value`; EFA carries 4 bytes of CQ data), the protocol's split of it
//! ([`imm_encode`] / [`imm_decode`]: [`IMM_SLOT_BITS`] of slot id, [`IMM_VALUE_BITS`] of value,
//! [`ImmCodec::DEFAULT`]), and the id spaces of both modes ([`NormalImm`], [`LlImm`]).
//!
//! The proxy's workers decode every arrival with an [`ImmCodec`] of their `value_bits` setting
//! (the default split unless a caller asks for another; the engines always use the default);
//! the engines and kernels encode with the default split. One codec, so the two cannot drift.

use super::base::*;
use crate::{Error, Result};

/// Encodes and decodes immediates for one split: the low `value_bits` bits carry the value,
/// the rest name the slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImmCodec {
    value_bits: u32,
    mask: u32,
}

/// A split that does not exist or a part that does not fit; `what` names it (`value_bits`,
/// `imm value`, `imm slot`). The proxy reports it as an invalid setting (`ProxyError`'s
/// `InvalidConfig`, same `what` and message).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid immediate `{what}`: {msg}")]
pub struct ImmError {
    pub what: &'static str,
    pub msg: String,
}

impl ImmCodec {
    /// The default split: 18 bits of slot, 14 bits of value (the protocol's).
    pub const DEFAULT_VALUE_BITS: u32 = IMM_VALUE_BITS;

    /// The protocol's split ([`IMM_VALUE_BITS`]), what [`imm_encode`] and [`imm_decode`] use.
    pub const DEFAULT: ImmCodec = ImmCodec { value_bits: IMM_VALUE_BITS, mask: IMM_VALUE_MAX };

    /// `value_bits` in `0..=32`.
    pub fn new(value_bits: u32) -> std::result::Result<Self, ImmError> {
        if value_bits > 32 {
            return Err(ImmError { what: "value_bits", msg: format!("{value_bits} > 32") });
        }
        let mask = if value_bits == 32 { u32::MAX } else { (1u32 << value_bits) - 1 };
        Ok(ImmCodec { value_bits, mask })
    }

    pub fn value_bits(&self) -> u32 {
        self.value_bits
    }

    /// Largest value an immediate carries.
    pub fn max_value(&self) -> u32 {
        self.mask
    }

    /// Number of distinct slots an immediate can name.
    pub fn max_slots(&self) -> u64 {
        1u64 << (32 - self.value_bits)
    }

    /// `slot << value_bits | value`; errors name whichever part does not fit.
    pub fn encode(&self, slot: u32, value: u32) -> std::result::Result<u32, ImmError> {
        if value > self.mask {
            return Err(ImmError {
                what: "imm value",
                msg: format!("{value} does not fit in {} bits", self.value_bits),
            });
        }
        if u64::from(slot) >= self.max_slots() {
            return Err(ImmError {
                what: "imm slot",
                msg: format!("{slot} does not fit in {} bits", 32 - self.value_bits),
            });
        }
        Ok(self.pack(slot, value))
    }

    /// [`Self::encode`] of parts already checked to fit.
    #[inline]
    fn pack(&self, slot: u32, value: u32) -> u32 {
        ((u64::from(slot) << self.value_bits) as u32) | value
    }

    /// `(slot, value)`.
    #[inline]
    pub fn decode(&self, imm: u32) -> (u32, u32) {
        ((u64::from(imm) >> self.value_bits) as u32, imm & self.mask)
    }
}

impl Default for ImmCodec {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Pack `(slot_id, value)` with the protocol's split ([`ImmCodec::DEFAULT`]); errors (naming
/// `slot_id`, then `value`) if either does not fit.
pub fn imm_encode(slot_id: u64, value: u64) -> Result<u32> {
    let c = ImmCodec::DEFAULT;
    if slot_id >= c.max_slots() {
        return Err(Error::arg("slot_id", format!("{slot_id} does not fit {IMM_SLOT_BITS} bits")));
    }
    if value > u64::from(c.max_value()) {
        return Err(Error::arg("value", format!("{value} does not fit {IMM_VALUE_BITS} bits")));
    }
    Ok(c.pack(slot_id as u32, value as u32))
}

/// Unpack into `(slot_id, value)` with the protocol's split.
pub fn imm_decode(imm: u32) -> (u64, u64) {
    let (slot, value) = ImmCodec::DEFAULT.decode(imm);
    (u64::from(slot), u64::from(value))
}

/// Which direction of a normal-mode step a data write belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Dispatch = 0,
    Combine = 1,
}

/// A decoded normal-mode immediate. `src` is always the rank that posted the write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormalMsg {
    /// A chunk landed in the receiver's slot `(src, slot)`; `rows` tokens (1..=chunk_tokens).
    Data { phase: Phase, src: u64, slot: u64, rows: u64 },
    /// `src`'s notify record landed; `seq14` is its notify sequence number mod 2^14.
    Notify { src: u64, seq14: u64 },
    /// `src` consumed `chunks` chunks this rank sent it; their slots may be reused.
    Credit { src: u64, chunks: u64 },
}

/// The normal-mode slot id space, seen from the receiving rank:
///
/// ```text
/// data:   [0, 2*R*spp)          id = (phase * R + src) * spp + slot
/// notify: [2*R*spp, +R)         id = 2*R*spp + src
/// credit: [2*R*spp + R, +R)     id = 2*R*spp + R + src
/// ```
///
/// `R * (2 * spp + 2)` ids must fit in 18 bits (1024 ranks: spp <= 127).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormalImm {
    pub num_ranks: u64,
    pub slots_per_peer: u64,
}

impl NormalImm {
    /// Errors (naming `slots_per_peer`, or `num_ranks` when even one slot does not fit) if the
    /// id space exceeds 18 bits.
    pub fn new(num_ranks: u64, slots_per_peer: u64) -> Result<Self> {
        if num_ranks == 0 {
            return Err(Error::arg("num_ranks", "must be at least 1"));
        }
        if slots_per_peer == 0 {
            return Err(Error::arg("slots_per_peer", "must be at least 1"));
        }
        let ids = num_ranks.checked_mul(2 * slots_per_peer.min(IMM_NUM_SLOT_IDS) + 2);
        if ids.is_none_or(|n| n > IMM_NUM_SLOT_IDS) {
            let max_spp = (IMM_NUM_SLOT_IDS / num_ranks).saturating_sub(2) / 2;
            if max_spp == 0 {
                return Err(Error::arg(
                    "num_ranks",
                    format!("{num_ranks} ranks do not fit the 18-bit immediate slot ids"),
                ));
            }
            return Err(Error::arg(
                "slots_per_peer",
                format!(
                    "{slots_per_peer} with {num_ranks} ranks needs more than 2^{IMM_SLOT_BITS} \
                     immediate slot ids; at most {max_spp}"
                ),
            ));
        }
        Ok(NormalImm { num_ranks, slots_per_peer })
    }

    /// Ids in use, `R * (2 * spp + 2)`.
    pub fn num_ids(&self) -> u64 {
        self.num_ranks * (2 * self.slots_per_peer + 2)
    }

    fn data_ids(&self) -> u64 {
        2 * self.num_ranks * self.slots_per_peer
    }

    fn check_src(&self, src: u64) -> Result<()> {
        if src >= self.num_ranks {
            return Err(Error::arg("src", format!("{src} not in 0..{}", self.num_ranks)));
        }
        Ok(())
    }

    /// Immediate of a data chunk from `src` into slot `slot` carrying `rows` tokens.
    pub fn data(&self, phase: Phase, src: u64, slot: u64, rows: u64) -> Result<u32> {
        self.check_src(src)?;
        if slot >= self.slots_per_peer {
            return Err(Error::arg("slot", format!("{slot} not in 0..{}", self.slots_per_peer)));
        }
        imm_encode(((phase as u64) * self.num_ranks + src) * self.slots_per_peer + slot, rows)
    }

    /// Immediate of `src`'s notify record with sequence number `seq`.
    pub fn notify(&self, src: u64, seq: u64) -> Result<u32> {
        self.check_src(src)?;
        imm_encode(self.data_ids() + src, seq & IMM_VALUE_MAX as u64)
    }

    /// Immediate of a credit from `src` returning `chunks` chunks.
    pub fn credit(&self, src: u64, chunks: u64) -> Result<u32> {
        self.check_src(src)?;
        imm_encode(self.data_ids() + self.num_ranks + src, chunks)
    }

    /// Decode an immediate that arrived; errors (naming `imm`) on ids outside the space.
    pub fn decode(&self, imm: u32) -> Result<NormalMsg> {
        let (id, value) = imm_decode(imm);
        let d = self.data_ids();
        if id < d {
            let slot = id % self.slots_per_peer;
            let ps = id / self.slots_per_peer;
            let phase = if ps >= self.num_ranks { Phase::Combine } else { Phase::Dispatch };
            Ok(NormalMsg::Data { phase, src: ps % self.num_ranks, slot, rows: value })
        } else if id < d + self.num_ranks {
            Ok(NormalMsg::Notify { src: id - d, seq14: value })
        } else if id < d + 2 * self.num_ranks {
            Ok(NormalMsg::Credit { src: id - d - self.num_ranks, chunks: value })
        } else {
            Err(Error::arg(
                "imm",
                format!("{imm:#010x}: slot id {id} outside 0..{}", self.num_ids()),
            ))
        }
    }
}

/// A decoded low-latency immediate; `value` fields are row counts (0 allowed: every pair
/// always gets one message, so the receiver knows when it is complete).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlMsg {
    /// Rank `src` sent `count` tokens for the receiver's local expert `local_expert`.
    Dispatch { set: u64, local_expert: u64, src: u64, count: u64 },
    /// Rank `src` returned `count` rows of its local expert `local_expert` (global expert
    /// `src * L + local_expert`) for the receiver's tokens.
    Combine { set: u64, src: u64, local_expert: u64, count: u64 },
}

/// The low-latency slot id space, seen from the receiving rank:
///
/// ```text
/// id = ((phase * 2 + set) * E) + unit
/// dispatch: unit = local_expert * R + src     (the receive block [local_expert][src])
/// combine:  unit = src * L + local_expert     (the global expert that answered)
/// ```
///
/// `4 * E` ids must fit in 18 bits: `num_experts <= 65536`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlImm {
    pub num_ranks: u64,
    pub num_experts: u64,
}

impl LlImm {
    pub fn new(num_ranks: u64, num_experts: u64) -> Result<Self> {
        if num_ranks == 0 {
            return Err(Error::arg("num_ranks", "must be at least 1"));
        }
        if num_experts == 0 || num_experts % num_ranks != 0 {
            return Err(Error::arg(
                "num_experts",
                format!("{num_experts} is not a positive multiple of num_ranks {num_ranks}"),
            ));
        }
        if num_experts > IMM_NUM_SLOT_IDS / (2 * LL_NUM_SETS) {
            return Err(Error::arg(
                "num_experts",
                format!(
                    "{num_experts} needs more than 2^{IMM_SLOT_BITS} immediate slot ids; at most {}",
                    IMM_NUM_SLOT_IDS / (2 * LL_NUM_SETS)
                ),
            ));
        }
        Ok(LlImm { num_ranks, num_experts })
    }

    fn local(&self) -> u64 {
        self.num_experts / self.num_ranks
    }

    /// Ids in use, `4 * E`.
    pub fn num_ids(&self) -> u64 {
        2 * LL_NUM_SETS * self.num_experts
    }

    fn check(&self, set: u64, rank: u64, local_expert: u64) -> Result<()> {
        if set >= LL_NUM_SETS {
            return Err(Error::arg("set", format!("{set} not in 0..{LL_NUM_SETS}")));
        }
        if rank >= self.num_ranks {
            return Err(Error::arg("src", format!("{rank} not in 0..{}", self.num_ranks)));
        }
        if local_expert >= self.local() {
            return Err(Error::arg(
                "local_expert",
                format!("{local_expert} not in 0..{}", self.local()),
            ));
        }
        Ok(())
    }

    /// Immediate of a dispatch message from `src` for the destination's `local_expert`.
    pub fn dispatch(&self, set: u64, local_expert: u64, src: u64, count: u64) -> Result<u32> {
        self.check(set, src, local_expert)?;
        imm_encode(set * self.num_experts + local_expert * self.num_ranks + src, count)
    }

    /// Immediate of a combine message from expert rank `src` (its `local_expert`).
    pub fn combine(&self, set: u64, src: u64, local_expert: u64, count: u64) -> Result<u32> {
        self.check(set, src, local_expert)?;
        imm_encode(
            (LL_NUM_SETS + set) * self.num_experts + src * self.local() + local_expert,
            count,
        )
    }

    /// Decode an immediate that arrived; errors (naming `imm`) on ids outside the space.
    pub fn decode(&self, imm: u32) -> Result<LlMsg> {
        let (id, count) = imm_decode(imm);
        if id >= self.num_ids() {
            return Err(Error::arg(
                "imm",
                format!("{imm:#010x}: slot id {id} outside 0..{}", self.num_ids()),
            ));
        }
        let (ps, unit) = (id / self.num_experts, id % self.num_experts);
        let set = ps % LL_NUM_SETS;
        Ok(if ps < LL_NUM_SETS {
            LlMsg::Dispatch {
                set,
                local_expert: unit / self.num_ranks,
                src: unit % self.num_ranks,
                count,
            }
        } else {
            LlMsg::Combine {
                set,
                src: unit / self.local(),
                local_expert: unit % self.local(),
                count,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_limits() {
        for bits in [0u32, 1, 14, 31, 32] {
            let c = ImmCodec::new(bits).unwrap();
            let max_slot = (c.max_slots() - 1) as u32;
            for (s, v) in [(0, 0), (max_slot, c.max_value()), (max_slot / 3, c.max_value() / 5)] {
                let imm = c.encode(s, v).unwrap();
                assert_eq!(c.decode(imm), (s, v), "bits {bits}");
            }
            if bits < 32 {
                assert!(c.encode(0, c.max_value() + 1).is_err());
            }
            if bits > 0 {
                assert!(c.encode(max_slot + 1, 0).is_err());
            }
        }
        assert!(ImmCodec::new(33).is_err());
        assert_eq!(ImmCodec::default(), ImmCodec::new(14).unwrap());
    }

    #[test]
    fn the_protocol_split_is_the_default_codec() {
        let c = ImmCodec::DEFAULT;
        assert_eq!(c, ImmCodec::new(IMM_VALUE_BITS).unwrap());
        assert_eq!((c.max_slots(), c.max_value()), (IMM_NUM_SLOT_IDS, IMM_VALUE_MAX));
        for (s, v) in [(0u32, 0u32), (1, 2), ((1 << 18) - 1, 0x3fff), (12345, 678)] {
            let imm = c.encode(s, v).unwrap();
            assert_eq!(imm_encode(u64::from(s), u64::from(v)).unwrap(), imm);
            assert_eq!(imm_decode(imm), (u64::from(s), u64::from(v)));
        }
        // Both fronts refuse what does not fit, each naming the part in its own terms.
        assert!(matches!(
            imm_encode(1 << 18, 0),
            Err(Error::InvalidArgument { arg: "slot_id", .. })
        ));
        assert!(matches!(imm_encode(0, 1 << 14), Err(Error::InvalidArgument { arg: "value", .. })));
        assert_eq!(c.encode(0, 1 << 14).unwrap_err().what, "imm value");
        assert_eq!(c.encode(1 << 18, 0).unwrap_err().what, "imm slot");
    }
}
