//! The dispatch format ([`DispatchDtype`]): a leaf type of its own because both the layouts
//! (plan/) and the configuration built on them (config.rs, which re-exports it as
//! `protocol::config::DispatchDtype`) need it.

/// Format of `x` in dispatch. Combine is always bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DispatchDtype {
    /// `x [tokens, hidden]` bf16.
    Bf16 = 0,
    /// `x [tokens, hidden]` e4m3fn plus `scales [tokens, hidden / 128]` f32.
    Fp8E4m3 = 1,
}

impl DispatchDtype {
    /// Bytes of one token's data, scales included.
    pub fn token_bytes(self, hidden: u64) -> u64 {
        match self {
            DispatchDtype::Bf16 => hidden * 2,
            DispatchDtype::Fp8E4m3 => hidden + hidden / 128 * 4,
        }
    }
}
