//! `#[repr(C)]` mirrors of the ring records in `kernels/include/fep_abi.h`.
//!
//! NOTES: these must match fep_abi.h byte for byte (the asserts below pin sizes and offsets). They
//! move to `crate::abi` (bindgen-generated) at merge; until then this is the proxy's own copy.

use std::mem::{offset_of, size_of};

/// One proxy command (`fep_cmd`, 32 bytes): written by the producer, read by the proxy worker.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct FepCmd {
    /// Bytes into the sender's registered send region.
    pub local_offset: u64,
    /// Bytes into the receiver's registered receive region.
    pub remote_offset: u64,
    /// Bytes to write; 0 is a valid count-only message.
    pub length: u32,
    /// Global rank of the receiver.
    pub dst_rank: u32,
    /// Immediate data delivered with the write (`slot << value_bits | value`).
    pub imm: u32,
    /// Low 32 bits of the entry's ticket; the consumer checks it.
    pub seq: u32,
}

/// The ring header (`fep_ring_hdr`, 128 bytes): head and tail on their own 64-byte lines.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct FepRingHdr {
    /// Written by the producer only: tickets `[0, head)` are published.
    pub head: u64,
    pub _pad0: [u64; 7],
    /// Written by the consumer only: tickets `[0, tail)` are consumed.
    pub tail: u64,
    pub _pad1: [u64; 7],
}

/// Bytes of one command entry.
pub const CMD_BYTES: usize = size_of::<FepCmd>();
/// Bytes of the ring header that precedes the entries.
pub const RING_HDR_BYTES: usize = size_of::<FepRingHdr>();
/// Offset of `head` in the header.
pub const HEAD_OFFSET: usize = offset_of!(FepRingHdr, head);
/// Offset of `tail` in the header.
pub const TAIL_OFFSET: usize = offset_of!(FepRingHdr, tail);

const _: () = assert!(size_of::<FepCmd>() == 32, "fep_cmd layout");
const _: () = assert!(offset_of!(FepCmd, local_offset) == 0);
const _: () = assert!(offset_of!(FepCmd, remote_offset) == 8);
const _: () = assert!(offset_of!(FepCmd, length) == 16);
const _: () = assert!(offset_of!(FepCmd, dst_rank) == 20);
const _: () = assert!(offset_of!(FepCmd, imm) == 24);
const _: () = assert!(offset_of!(FepCmd, seq) == 28);
const _: () = assert!(size_of::<FepRingHdr>() == 128, "fep_ring_hdr layout");
const _: () = assert!(offset_of!(FepRingHdr, head) == 0);
const _: () = assert!(offset_of!(FepRingHdr, tail) == 64);
