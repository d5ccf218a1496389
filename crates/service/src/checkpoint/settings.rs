//! The `[checkpoint]` settings: where checkpoints go, and how often.
//!
//! Off by default (an empty `dir`): a start then takes a full snapshot, as
//! it always has. The rule that ties this section to `[stream]` (no
//! checkpoints with a temporary slot) is checked where the sections are
//! composed (`config`), since neither section knows the other.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::setting::InvalidSetting;

/// The longest interval: a day. The owner keeps the WAL of one interval
/// for the slot, so a longer one is a disk the owner fills, not a saving.
const MAX_INTERVAL_SECS: u64 = 86_400;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSettings {
    /// The directory checkpoints are written to and loaded from; empty
    /// turns checkpoints off.
    pub dir: String,
    /// Seconds between background checkpoints.
    pub interval_secs: u64,
}

impl CheckpointSettings {
    /// The directory, when checkpoints are on.
    pub fn dir(&self) -> Option<&Path> {
        (!self.dir.is_empty()).then(|| Path::new(&self.dir))
    }

    pub fn enabled(&self) -> bool {
        self.dir().is_some()
    }

    pub fn interval(&self) -> Duration {
        Duration::from_secs(self.interval_secs)
    }

    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if !self.dir.is_empty() {
            let dir = PathBuf::from(&self.dir);
            // A relative directory would depend on where the service was
            // started from (a shell, systemd, a container's workdir): a
            // restart could look elsewhere and take a full snapshot.
            if !dir.is_absolute() || self.dir.trim() != self.dir {
                return Err(InvalidSetting::new(
                    "checkpoint.dir",
                    "must be empty (off) or an absolute path, without surrounding spaces",
                ));
            }
        }
        if self.interval_secs == 0 || self.interval_secs > MAX_INTERVAL_SECS {
            return Err(InvalidSetting::new(
                "checkpoint.interval_secs",
                format!("must be between 1 and {MAX_INTERVAL_SECS} seconds"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(dir: &str, interval_secs: u64) -> CheckpointSettings {
        CheckpointSettings {
            dir: dir.to_string(),
            interval_secs,
        }
    }

    #[test]
    fn off_unless_a_directory_is_named() {
        assert!(!settings("", 300).enabled());
        assert!(settings("", 300).validate().is_ok());
        let on = settings("/var/lib/vacancy", 300);
        assert!(on.validate().is_ok());
        assert_eq!(on.dir(), Some(Path::new("/var/lib/vacancy")));
        assert_eq!(on.interval(), Duration::from_secs(300));
    }

    #[test]
    fn rules_name_their_field() {
        for dir in ["relative/dir", " /var/lib/vacancy", "/var/lib/vacancy "] {
            let e = settings(dir, 300).validate().unwrap_err();
            assert_eq!(e.field, "checkpoint.dir", "{dir:?}");
        }
        for interval in [0, MAX_INTERVAL_SECS + 1] {
            let e = settings("", interval).validate().unwrap_err();
            assert_eq!(e.field, "checkpoint.interval_secs");
        }
    }
}
