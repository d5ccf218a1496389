//! The `[model]` settings: how long a calendar is trusted without a
//! confirmation, and how many the safety net re-reads at once.

use serde::Deserialize;

use crate::setting::InvalidSetting;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSettings {
    pub ttl_secs: u64,
    pub refresh_batch: u32,
}

impl ModelSettings {
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.ttl_secs == 0 {
            return Err(InvalidSetting::new(
                "model.ttl_secs",
                "must be at least 1 second",
            ));
        }
        if self.refresh_batch == 0 || self.refresh_batch > 10_000 {
            return Err(InvalidSetting::new(
                "model.refresh_batch",
                "must be between 1 and 10000",
            ));
        }
        Ok(())
    }
}
