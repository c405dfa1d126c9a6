//! The ring records of `kernels/include/fep_abi.h`, as the proxy names them: aliases of the
//! bindgen-generated structs in [`crate::abi`], so the proxy, the kernels and the CUDA layer
//! share one definition and cannot drift.
//!
//! NOTES: the asserts below repeat the offsets the proxy's code relies on (head and tail on their
//! own 64-byte lines, `seq` last); `crate::abi` checks the sizes against the header's own
//! `static_assert`s.

use std::mem::{offset_of, size_of};

use crate::abi;

/// One proxy command (`fep_cmd`, 32 bytes): written by the producer, read by the proxy worker.
/// Fields: `local_offset` (bytes into the sender's send region), `remote_offset` (bytes into the
/// receiver's receive region), `length` (0 is a valid count-only message), `dst_rank`, `imm`
/// (`slot << value_bits | value`) and `seq` (low 32 bits of the entry's ticket).
pub type FepCmd = abi::fep_cmd;

/// The ring header (`fep_ring_hdr`, 128 bytes): `head` (producer) and `tail` (consumer) on their
/// own 64-byte lines.
pub type FepRingHdr = abi::fep_ring_hdr;

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
const _: () = assert!(RING_HDR_BYTES + 4 * CMD_BYTES == abi::ring_bytes(4));
