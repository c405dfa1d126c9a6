//! Memory regions: how a buffer of equal units is split into regions no larger than a
//! provider's limit ([`RegionPlan`]), never splitting a unit.

use crate::{Error, Result};

/// How a buffer of `total_units` equal units is split into memory regions no larger than a
/// provider's limit, never splitting a unit (one RMA write always targets one region).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionPlan {
    pub unit_bytes: u64,
    pub total_units: u64,
    pub units_per_region: u64,
    pub num_regions: u64,
}

impl RegionPlan {
    /// Errors (naming `max_region_bytes`) when one unit is larger than a region may be.
    pub fn new(unit_bytes: u64, total_units: u64, max_region_bytes: u64) -> Result<Self> {
        if unit_bytes == 0 {
            return Err(Error::arg("unit_bytes", "must be positive"));
        }
        let units_per_region = max_region_bytes / unit_bytes;
        if units_per_region == 0 {
            return Err(Error::arg(
                "max_region_bytes",
                format!("{max_region_bytes} is smaller than one unit of {unit_bytes} bytes"),
            ));
        }
        let units_per_region = units_per_region.min(total_units.max(1));
        Ok(RegionPlan {
            unit_bytes,
            total_units,
            units_per_region,
            num_regions: total_units.div_ceil(units_per_region),
        })
    }

    /// Bytes of the whole buffer.
    pub fn total_bytes(&self) -> u64 {
        self.total_units * self.unit_bytes
    }

    /// Byte range `(offset, len)` of region `i` within the buffer.
    pub fn region_range(&self, i: u64) -> Result<(u64, u64)> {
        if i >= self.num_regions {
            return Err(Error::arg("region", format!("{i} not in 0..{}", self.num_regions)));
        }
        let first = i * self.units_per_region;
        let units = self.units_per_region.min(self.total_units - first);
        Ok((first * self.unit_bytes, units * self.unit_bytes))
    }

    /// `(region, offset within region)` of a buffer byte offset.
    pub fn locate(&self, offset: u64) -> Result<(u64, u64)> {
        if offset >= self.total_bytes() {
            return Err(Error::arg("offset", format!("{offset} not in 0..{}", self.total_bytes())));
        }
        let region_bytes = self.units_per_region * self.unit_bytes;
        Ok((offset / region_bytes, offset % region_bytes))
    }
}
