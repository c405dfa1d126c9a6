//! The 4-byte immediate: `slot << value_bits | value` (EFA carries 4 bytes of CQ data).

use super::ProxyError;

/// Encodes and decodes immediates for one proxy's `value_bits`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImmCodec {
    value_bits: u32,
    mask: u32,
}

impl ImmCodec {
    /// The default split: 18 bits of slot, 14 bits of value.
    pub const DEFAULT_VALUE_BITS: u32 = 14;

    /// `value_bits` in `0..=32`.
    pub fn new(value_bits: u32) -> Result<Self, ProxyError> {
        if value_bits > 32 {
            return Err(ProxyError::InvalidConfig {
                what: "value_bits",
                msg: format!("{value_bits} > 32"),
            });
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
    pub fn encode(&self, slot: u32, value: u32) -> Result<u32, ProxyError> {
        if value > self.mask {
            return Err(ProxyError::InvalidConfig {
                what: "imm value",
                msg: format!("{value} does not fit in {} bits", self.value_bits),
            });
        }
        if u64::from(slot) >= self.max_slots() {
            return Err(ProxyError::InvalidConfig {
                what: "imm slot",
                msg: format!("{slot} does not fit in {} bits", 32 - self.value_bits),
            });
        }
        Ok(((u64::from(slot) << self.value_bits) as u32) | value)
    }

    /// `(slot, value)`.
    #[inline]
    pub fn decode(&self, imm: u32) -> (u32, u32) {
        ((u64::from(imm) >> self.value_bits) as u32, imm & self.mask)
    }
}

impl Default for ImmCodec {
    fn default() -> Self {
        ImmCodec { value_bits: Self::DEFAULT_VALUE_BITS, mask: (1 << Self::DEFAULT_VALUE_BITS) - 1 }
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
}
