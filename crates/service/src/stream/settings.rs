//! The `[stream]` settings: the publication, the slot and the loop's pace.

use std::time::Duration;

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
    /// A replication read that receives nothing for this long ends the
    /// session as dead (0: never); see `receive_timeout`.
    pub receive_timeout_ms: u64,
}

/// How many heartbeats a receive timeout must span at least: one late
/// heartbeat (a busy owner, a slow commit) must not end a healthy session.
const HEARTBEATS_PER_RECEIVE_TIMEOUT: u64 = 3;

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
        let least = self
            .heartbeat_interval_ms
            .saturating_mul(HEARTBEATS_PER_RECEIVE_TIMEOUT);
        if self.receive_timeout_ms > 0 && self.receive_timeout_ms < least {
            return Err(InvalidSetting::new(
                "stream.receive_timeout_ms",
                format!(
                    "must be 0 (off) or at least {HEARTBEATS_PER_RECEIVE_TIMEOUT} x stream.heartbeat_interval_ms ({least}): the heartbeat is what an idle owner sends"
                ),
            ));
        }
        Ok(())
    }

    /// How long a replication read may receive nothing before the session
    /// is taken for dead, like PostgreSQL's `wal_receiver_timeout`.
    ///
    /// `None` without the heartbeat: keepalives that do not move the WAL
    /// end are answered inside pg_walstream and never reach the loop, so
    /// an idle owner without heartbeats would look dead. Then only the TCP
    /// settings of `[owner]` notice a dead path.
    pub fn receive_timeout(&self) -> Option<Duration> {
        (self.receive_timeout_ms > 0 && self.heartbeat_interval_ms > 0)
            .then(|| Duration::from_millis(self.receive_timeout_ms))
    }
}

/// A name we put into SQL unquoted: keep it to what needs no quoting.
fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
        && name.len() <= 63
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(heartbeat_interval_ms: u64, receive_timeout_ms: u64) -> StreamSettings {
        StreamSettings {
            publication: "vacancy".into(),
            slot: "vacancy".into(),
            temporary_slot: false,
            schema: "public".into(),
            reconnect_min_ms: 100,
            reconnect_max_ms: 10_000,
            heartbeat_interval_ms,
            stream_in_progress: true,
            slot_watch_interval_ms: 5000,
            receive_timeout_ms,
        }
    }

    #[test]
    fn the_receive_timeout_needs_the_heartbeat_and_spans_three_beats() {
        let on = with(1000, 10_000);
        on.validate().expect("the defaults");
        assert_eq!(on.receive_timeout(), Some(Duration::from_secs(10)));
        with(1000, 3000).validate().expect("three beats");
        // Off, or without the heartbeat an idle owner would look dead.
        assert_eq!(with(1000, 0).receive_timeout(), None);
        with(0, 10_000).validate().expect("no heartbeat: not armed");
        assert_eq!(with(0, 10_000).receive_timeout(), None);
        for (heartbeat, receive) in [(1000, 2999), (u64::MAX, 10_000)] {
            let e = with(heartbeat, receive).validate().unwrap_err();
            assert_eq!(e.field, "stream.receive_timeout_ms");
            assert!(e.rule.contains("stream.heartbeat_interval_ms"), "{e}");
        }
    }
}
