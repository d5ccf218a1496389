//! The `[search]` settings: when to read the owner (and how: confirmed
//! reads or rows), how long to wait for it, and the limits of a question.

use serde::Deserialize;

use crate::setting::InvalidSetting;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchSettings {
    pub few_units_threshold: i32,
    pub owner_read_timeout_ms: u64,
    pub owner_read_cache_ms: u64,
    pub owner_read_connections: usize,
    pub max_lag_ms: u64,
    pub horizon_days: u32,
    pub max_stay_nights: u32,
    pub min_lsn_wait_ms: u64,
    pub when_lagging: WhenLagging,
    pub fresh_reads: FreshReads,
    /// Lab only: bracket every answer with the owner's flushed WAL position
    /// (`SearchAnswer::owner_position`), at two owner round trips per search.
    pub stamp_owner_position: bool,
}

/// How a search makes its few-unit room types owner-fresh.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FreshReads {
    /// Take an owner WAL position after the search began, wait for the copy
    /// to apply it, and answer from the copy (`source: confirmed`). Rows
    /// stay the fallback, within the same `owner_read_timeout_ms`.
    Confirmed,
    /// Read the room types' rows from the owner (`source: owner`).
    Rows,
}

/// What a search does when the copy lags past `search.max_lag_ms`.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum WhenLagging {
    /// 503 with Retry-After.
    Refuse,
    /// Read every shown room type from the owner.
    Owner,
}

impl SearchSettings {
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.few_units_threshold < 0 {
            return Err(InvalidSetting::new(
                "search.few_units_threshold",
                "must be 0 or more",
            ));
        }
        if self.owner_read_timeout_ms == 0 {
            return Err(InvalidSetting::new(
                "search.owner_read_timeout_ms",
                "must be above 0",
            ));
        }
        if self.owner_read_cache_ms >= 1000 {
            return Err(InvalidSetting::new(
                "search.owner_read_cache_ms",
                "must be well under a second (below 1000)",
            ));
        }
        if !(1..=64).contains(&self.owner_read_connections) {
            return Err(InvalidSetting::new(
                "search.owner_read_connections",
                "must be between 1 and 64",
            ));
        }
        if self.max_stay_nights == 0 || self.max_stay_nights > self.horizon_days {
            return Err(InvalidSetting::new(
                "search.max_stay_nights",
                "must be above 0 and at most search.horizon_days",
            ));
        }
        Ok(())
    }
}
