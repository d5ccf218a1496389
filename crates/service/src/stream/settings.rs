//! The `[stream]` settings: the publication, the slot and the loop's pace.

use serde::Deserialize;

use crate::setting::InvalidSetting;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamSettings {
    pub publication: String,
    pub slot: String,
    pub temporary_slot: bool,
    pub schema: String,
    pub reconnect_min_ms: u64,
    pub reconnect_max_ms: u64,
    pub heartbeat_interval_ms: u64,
    pub stream_in_progress: bool,
    pub slot_watch_interval_ms: u64,
}

impl StreamSettings {
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        for (field, name) in [
            ("stream.publication", &self.publication),
            ("stream.slot", &self.slot),
            ("stream.schema", &self.schema),
        ] {
            if !is_identifier(name) {
                return Err(InvalidSetting::new(
                    field,
                    "must be 1 to 63 lowercase letters, digits or underscores, starting with a letter or underscore",
                ));
            }
        }
        if self.reconnect_min_ms == 0 || self.reconnect_min_ms > self.reconnect_max_ms {
            return Err(InvalidSetting::new(
                "stream.reconnect_min_ms",
                "must be above 0 and at most stream.reconnect_max_ms",
            ));
        }
        if self.slot_watch_interval_ms == 0 {
            return Err(InvalidSetting::new(
                "stream.slot_watch_interval_ms",
                "must be above 0",
            ));
        }
        Ok(())
    }
}

/// A name we put into SQL unquoted: keep it to what needs no quoting.
fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
        && name.len() <= 63
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}
