//! `get_dispatch_layout` on the GPU: [`DispatchLayoutGpu`] runs `kernels/layout.cu` (one
//! launch) into device buffers ([`LayoutBuffers`]), with the semantics and argument checks of
//! the pure version ([`crate::protocol::layout`], the reference it is tested against). Kept in
//! `ep` because it launches a kernel; the pure function lives in the protocol core.

use crate::abi;
use crate::cuda::launch::{self, LaunchConfig};
use crate::cuda::{DevErrorRecord, Device, DeviceBuffer, Stream};
use crate::protocol::layout::{Layout, LayoutShape};
use crate::{Error, Result};

/// Output buffers of the GPU layout, on the device.
pub struct LayoutBuffers {
    /// int32 `[num_ranks]`
    pub num_tokens_per_rank: DeviceBuffer,
    /// int32 `[num_nodes]`
    pub num_tokens_per_node: DeviceBuffer,
    /// int32 `[num_experts]`
    pub num_tokens_per_expert: DeviceBuffer,
    /// bool (u8) `[capacity_tokens, num_ranks]`
    pub is_token_in_rank: DeviceBuffer,
}

impl LayoutBuffers {
    /// Buffers for up to `capacity_tokens` tokens.
    pub fn new(gpu: &DispatchLayoutGpu, capacity_tokens: usize) -> Result<LayoutBuffers> {
        let dev = gpu.device();
        Ok(LayoutBuffers {
            num_tokens_per_rank: DeviceBuffer::new(dev, 4 * gpu.num_ranks)?,
            num_tokens_per_node: DeviceBuffer::new(dev, 4 * (gpu.num_ranks / gpu.ranks_per_node))?,
            num_tokens_per_expert: DeviceBuffer::new(dev, 4 * gpu.num_experts)?,
            is_token_in_rank: DeviceBuffer::new(dev, capacity_tokens * gpu.num_ranks)?,
        })
    }

    /// Copies the first `num_tokens` rows back into a [`Layout`] (tests, host fallbacks).
    pub fn to_host(&self, num_tokens: usize) -> Result<Layout> {
        let num_ranks = self.num_tokens_per_rank.len() / 4;
        let all: Vec<u8> = self.is_token_in_rank.to_vec()?;
        let rows = all.get(..num_tokens * num_ranks).ok_or_else(|| {
            Error::arg(
                "num_tokens",
                format!("{num_tokens} rows, buffer holds {}", all.len() / num_ranks.max(1)),
            )
        })?;
        Ok(Layout {
            num_tokens_per_rank: self.num_tokens_per_rank.to_vec()?,
            num_tokens_per_node: self.num_tokens_per_node.to_vec()?,
            num_tokens_per_expert: self.num_tokens_per_expert.to_vec()?,
            // NOTES: any non-zero byte reads as true, so a poisoned (unwritten) row shows up as a
            // mismatch against the reference rather than passing.
            is_token_in_rank: rows.iter().map(|&b| b != 0).collect(),
        })
    }

    /// Fills every output with `byte` (tests poison outputs before each launch).
    pub fn poison(&self, byte: u8) -> Result<()> {
        self.num_tokens_per_rank.memset(byte)?;
        self.num_tokens_per_node.memset(byte)?;
        self.num_tokens_per_expert.memset(byte)?;
        self.is_token_in_rank.memset(byte)?;
        Ok(())
    }
}

/// Which layout kernel runs (kernels/layout.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutVariant {
    /// One thread-block cluster (8 blocks x 1024 threads) reducing through distributed shared
    /// memory: no workspace, no global atomics. Measured SLOWER on an H200 (4096 x top-8, 256
    /// experts, 64 ranks: median 16.7 us against 9.9 us for `Grid`): 8 SMs do all the work.
    /// Kept, tested, for comparison; never the default.
    Cluster,
    /// Any number of blocks (one per 32-token tile, up to 2 per SM), global-atomic reduction into
    /// the workspace with a last-block finish. The default.
    Grid,
}

/// Optional overrides of the launch shape (benchmarks and tests sweep them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayoutTuning {
    pub variant: Option<LayoutVariant>,
    /// Tokens per shared-memory tile (a multiple of 16).
    pub tile: Option<usize>,
}

/// Default tokens per tile of the grid variant (best of 16/32/64/128 at 4096 x top-8 on an H200;
/// 64 was 0.5 us better at 16384 tokens, within run-to-run noise).
pub const LAYOUT_GRID_DEFAULT_TILE: usize = 32;

/// A resolved launch: which kernel, its shape, and the tile size it was planned for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutPlan {
    pub variant: LayoutVariant,
    pub cfg: LaunchConfig,
    pub tile: usize,
}

/// The GPU `get_dispatch_layout` for a fixed (experts, ranks, ranks per node): owns the grid
/// variant's workspace, so launches on one instance must be ordered (one stream).
pub struct DispatchLayoutGpu {
    dev: Device,
    workspace: DeviceBuffer,
    num_experts: usize,
    num_ranks: usize,
    ranks_per_node: usize,
}

impl DispatchLayoutGpu {
    pub fn new(
        dev: &Device,
        num_experts: usize,
        num_ranks: usize,
        ranks_per_node: usize,
    ) -> Result<Self> {
        let shape = LayoutShape::new(0, 1, num_experts, num_ranks, ranks_per_node)?;
        let bins = num_experts + num_ranks + shape.num_nodes() + 1;
        // NOTES: zero once here; the grid kernel leaves it zero after every launch.
        let workspace = DeviceBuffer::zeroed(dev, 4 * bins)?;
        Ok(DispatchLayoutGpu {
            dev: dev.clone(),
            workspace,
            num_experts,
            num_ranks,
            ranks_per_node,
        })
    }

    pub fn num_experts(&self) -> usize {
        self.num_experts
    }
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }
    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Launch shape for `num_tokens x num_topk`. Grid variant (default): tile 32, one block per
    /// tile, at most two blocks per SM (blocks then stride over tiles). Cluster variant: one tile
    /// per block when it fits (tile = tokens / 8 rounded up to 16). Tiles shrink (halving) until
    /// the shared memory fits the device's limit.
    pub fn plan(
        &self,
        num_tokens: usize,
        num_topk: usize,
        tuning: LayoutTuning,
    ) -> Result<LayoutPlan> {
        let shape = LayoutShape::new(
            num_tokens,
            num_topk,
            self.num_experts,
            self.num_ranks,
            self.ranks_per_node,
        )?;
        let clusters_ok = self.dev.compute_capability().0 >= 9;
        let variant = tuning.variant.unwrap_or(LayoutVariant::Grid);
        let blocks = abi::FEP_LAYOUT_CLUSTER_BLOCKS as usize;
        let mut tile = match (tuning.tile, variant) {
            (Some(t), _) => t,
            (None, LayoutVariant::Cluster) => num_tokens.div_ceil(blocks).div_ceil(16).max(1) * 16,
            (None, LayoutVariant::Grid) => LAYOUT_GRID_DEFAULT_TILE,
        };
        if tile == 0 || tile % 16 != 0 || tile > i32::MAX as usize {
            return Err(Error::arg(
                "tuning.tile",
                format!("{tile}: must be a positive multiple of 16"),
            ));
        }
        let bins = self.num_experts + self.num_ranks + shape.num_nodes();
        let limit = self.dev.max_dynamic_smem() as usize;
        let smem =
            |tile: usize| ((bins + tile * num_topk) * 4).div_ceil(16) * 16 + tile * self.num_ranks;
        while smem(tile) > limit && tile > 16 {
            tile = (tile / 2).div_ceil(16) * 16;
        }
        if smem(tile) > limit {
            return Err(Error::arg(
                "num_experts",
                format!(
                    "layout kernel needs {} bytes of shared memory for {} experts, {} ranks, top-{num_topk} (limit {limit})",
                    smem(tile), self.num_experts, self.num_ranks
                ),
            ));
        }
        let cfg = match variant {
            LayoutVariant::Cluster => {
                if !clusters_ok {
                    return Err(Error::arg(
                        "tuning.variant",
                        "the cluster variant needs sm_90 or newer",
                    ));
                }
                LaunchConfig {
                    grid: abi::FEP_LAYOUT_CLUSTER_BLOCKS,
                    block: abi::FEP_LAYOUT_CLUSTER_THREADS,
                    shared_bytes: smem(tile) as u32,
                }
            }
            LayoutVariant::Grid => {
                let tiles = num_tokens.div_ceil(tile).max(1);
                let grid = tiles.min(2 * self.dev.sm_count().max(1) as usize) as u32;
                LaunchConfig {
                    grid,
                    block: abi::FEP_LAYOUT_THREADS,
                    shared_bytes: smem(tile) as u32,
                }
            }
        };
        Ok(LayoutPlan { variant, cfg, tile })
    }

    /// Launches the layout of `topk_idx` (int64 `[num_tokens, num_topk]` on the device) into
    /// `out` on `stream`. `err`, when given, receives out-of-range indices (checked by the caller
    /// after synchronising, with [`DevErrorRecord::check`]); such entries are skipped.
    ///
    /// # Safety
    /// `topk_idx`, `out` and `err` must stay alive until `stream` has finished the launch, and no
    /// other launch on this instance may run concurrently (shared workspace).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        topk_idx: &DeviceBuffer,
        num_tokens: usize,
        num_topk: usize,
        out: &LayoutBuffers,
        err: Option<&DevErrorRecord>,
        rank: u32,
        tuning: LayoutTuning,
    ) -> Result<()> {
        let need = |what: &'static str, buf: &DeviceBuffer, bytes: usize| {
            if buf.len() < bytes {
                Err(Error::arg(what, format!("{} bytes, needs {bytes}", buf.len())))
            } else {
                Ok(())
            }
        };
        LayoutShape::new(
            num_tokens,
            num_topk,
            self.num_experts,
            self.num_ranks,
            self.ranks_per_node,
        )?;
        need("topk_idx", topk_idx, num_tokens * num_topk * 8)?;
        need("num_tokens_per_rank", &out.num_tokens_per_rank, 4 * self.num_ranks)?;
        need(
            "num_tokens_per_node",
            &out.num_tokens_per_node,
            4 * (self.num_ranks / self.ranks_per_node),
        )?;
        need("num_tokens_per_expert", &out.num_tokens_per_expert, 4 * self.num_experts)?;
        need("is_token_in_rank", &out.is_token_in_rank, num_tokens * self.num_ranks)?;
        let p = abi::fep_layout_params {
            topk_idx: topk_idx.device_ptr(),
            num_tokens_per_rank: out.num_tokens_per_rank.device_ptr(),
            num_tokens_per_node: out.num_tokens_per_node.device_ptr(),
            num_tokens_per_expert: out.num_tokens_per_expert.device_ptr(),
            is_token_in_rank: out.is_token_in_rank.device_ptr(),
            dev_error: err.map_or(Default::default(), |e| e.as_abi()),
            num_tokens: num_tokens as i32,
            num_topk: num_topk as i32,
            rank: rank as i32,
            ..Default::default()
        };
        // SAFETY: sizes checked above; lifetimes are the caller's contract.
        self.launch_raw(stream, p, tuning)
    }

    /// Raw form of [`Self::launch`] for callers holding device addresses (the C ABI, torch
    /// tensors): `is_token_in_rank` may be any address (16-byte aligned is fastest),
    /// `num_tokens_per_node` may be 0. The shape fields this instance owns (experts, ranks, ranks
    /// per node, tile, workspace) are filled in here.
    ///
    /// # Safety
    /// Every address in `p` must be live and sized as `fep_layout_params` documents, until the
    /// launch completes.
    pub unsafe fn launch_raw(
        &self,
        stream: &Stream,
        mut p: abi::fep_layout_params,
        tuning: LayoutTuning,
    ) -> Result<()> {
        if p.num_tokens < 0 || p.num_topk < 0 {
            return Err(Error::arg(
                "p",
                format!("num_tokens {} / num_topk {}", p.num_tokens, p.num_topk),
            ));
        }
        let plan = self.plan(p.num_tokens as usize, p.num_topk as usize, tuning)?;
        p.workspace = self.workspace.device_ptr();
        p.num_experts = self.num_experts as i32;
        p.num_ranks = self.num_ranks as i32;
        p.ranks_per_node = self.ranks_per_node as i32;
        p.tile_tokens = plan.tile as i32;
        match plan.variant {
            LayoutVariant::Cluster => launch::dispatch_layout_cluster(stream, plan.cfg, p),
            LayoutVariant::Grid => launch::dispatch_layout(stream, plan.cfg, p),
        }
        .map_err(Error::from)
    }
}
