//! The `[fleet]` settings: which role this process plays, and the names in
//! NATS JetStream that every node of one fleet must agree on.
//!
//! `standalone` (the default) is the single-machine service and touches no
//! NATS. The rules that tie this section to others (a quote key and booking
//! tokens on every fleet node, checkpoints on the projector) are checked
//! where the sections are composed (`config`).

use std::time::Duration;

use serde::Deserialize;

use crate::setting::InvalidSetting;

/// What this process does in a fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// One process: slot, copy and API; no NATS.
    Standalone,
    /// Holds the slot, applies, serves, and publishes what it applied and
    /// its checkpoints to JetStream.
    Projector,
    /// No slot: bootstraps from the projector's newest checkpoint and
    /// applies the stream of changes it publishes.
    Replica,
}

impl Role {
    pub fn label(self) -> &'static str {
        match self {
            Role::Standalone => "standalone",
            Role::Projector => "projector",
            Role::Replica => "replica",
        }
    }
}

/// The largest payload a message may have: below the server's default
/// `max_payload` (1 MiB) with room for headers.
const MAX_CHUNK_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSettings {
    pub role: Role,
    /// `nats://host:port`, required for `projector` and `replica`.
    pub nats_url: String,
    /// The JetStream stream that carries applied changes.
    pub stream: String,
    /// The subject the projector publishes changes on (the stream's only one).
    pub subject: String,
    /// The JetStream stream that carries take outcomes, every node's, so
    /// that every node counts all of them in one order (`fleet::outcomes`).
    pub outcomes_stream: String,
    /// The subject take outcomes are published on (that stream's only one).
    pub outcomes_subject: String,
    /// The object-store bucket that holds checkpoints.
    pub checkpoint_bucket: String,
    /// Checkpoints kept in the bucket; older ones are deleted.
    pub checkpoints_kept: u32,
    /// Both streams' duplicate window: a publish retried within it with
    /// the same message id is stored once.
    pub duplicate_window_secs: u64,
    /// Both streams' `max_age`. Must cover the span from the oldest kept
    /// checkpoint to now: at least `checkpoints_kept` checkpoint intervals
    /// (checked in `config`).
    pub max_age_secs: u64,
    /// Each stream's `max_bytes` (0: no limit but `max_age`).
    pub max_bytes: i64,
    /// A message's largest payload; a larger transaction is cut into chunks
    /// with a final commit marker.
    pub max_chunk_bytes: usize,
    /// Publishes waiting for JetStream's acknowledgement, at most. At the
    /// bound the projector stops reading WAL instead of buffering.
    pub max_publishes_in_flight: usize,
    /// How long one publish may wait for its acknowledgement before it is
    /// sent again (with the same message id).
    pub publish_ack_timeout_ms: u64,
    /// Connecting to NATS, and each JetStream request, gives up after this.
    pub request_timeout_ms: u64,
    /// A replica reads the owner's WAL position this often, for its lag and
    /// readiness.
    pub owner_position_interval_ms: u64,
    /// A replica is ready while it has applied the change stream to within
    /// this many messages of its end; the owner lag does not decide it (see
    /// `replica`'s readiness).
    pub ready_max_messages_behind: u64,
}

impl FleetSettings {
    pub fn is_fleet(&self) -> bool {
        self.role != Role::Standalone
    }

    pub fn publish_ack_timeout(&self) -> Duration {
        Duration::from_millis(self.publish_ack_timeout_ms)
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    pub fn owner_position_interval(&self) -> Duration {
        Duration::from_millis(self.owner_position_interval_ms)
    }

    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.is_fleet() && !self.nats_url.starts_with("nats://") {
            return Err(InvalidSetting::new(
                "fleet.nats_url",
                format!(
                    "must be a nats://host:port URL for role {}",
                    self.role.label()
                ),
            ));
        }
        for (field, value) in [
            ("fleet.stream", &self.stream),
            ("fleet.outcomes_stream", &self.outcomes_stream),
            ("fleet.checkpoint_bucket", &self.checkpoint_bucket),
        ] {
            // JetStream names: no spaces, dots, wildcards or separators.
            let bad = |c: char| c.is_whitespace() || ".*>/\\".contains(c);
            if value.is_empty() || value.chars().any(bad) {
                return Err(InvalidSetting::new(
                    field,
                    "must be a non-empty name without spaces, '.', '*', '>', '/' or '\\'",
                ));
            }
        }
        for (field, subject) in [
            ("fleet.subject", &self.subject),
            ("fleet.outcomes_subject", &self.outcomes_subject),
        ] {
            if subject.is_empty()
                || subject
                    .chars()
                    .any(|c| c.is_whitespace() || c == '*' || c == '>')
            {
                return Err(InvalidSetting::new(
                    field,
                    "must be a literal subject (no spaces or wildcards)",
                ));
            }
        }
        // JetStream refuses two streams over one subject; one stream over
        // both would mix changes and outcomes in one sequence.
        if self.outcomes_stream == self.stream || self.outcomes_subject == self.subject {
            return Err(InvalidSetting::new(
                "fleet.outcomes_stream",
                "the outcome stream and its subject must differ from fleet.stream and fleet.subject",
            ));
        }
        if self.checkpoints_kept == 0 {
            return Err(InvalidSetting::new(
                "fleet.checkpoints_kept",
                "must be at least 1",
            ));
        }
        if self.duplicate_window_secs == 0 || self.duplicate_window_secs > self.max_age_secs {
            return Err(InvalidSetting::new(
                "fleet.duplicate_window_secs",
                "must be at least 1 and no longer than fleet.max_age_secs",
            ));
        }
        if self.max_bytes < 0 {
            return Err(InvalidSetting::new(
                "fleet.max_bytes",
                "must be 0 (no limit) or a positive number of bytes",
            ));
        }
        if !(4096..=MAX_CHUNK_BYTES - 4096).contains(&self.max_chunk_bytes) {
            return Err(InvalidSetting::new(
                "fleet.max_chunk_bytes",
                format!(
                    "must be between 4096 and {} (the server's default max_payload less room for headers)",
                    MAX_CHUNK_BYTES - 4096
                ),
            ));
        }
        if self.max_publishes_in_flight == 0 || self.max_publishes_in_flight > 65_536 {
            return Err(InvalidSetting::new(
                "fleet.max_publishes_in_flight",
                "must be between 1 and 65536",
            ));
        }
        for (field, ms) in [
            ("fleet.publish_ack_timeout_ms", self.publish_ack_timeout_ms),
            ("fleet.request_timeout_ms", self.request_timeout_ms),
            (
                "fleet.owner_position_interval_ms",
                self.owner_position_interval_ms,
            ),
        ] {
            if !(10..=600_000).contains(&ms) {
                return Err(InvalidSetting::new(
                    field,
                    "must be between 10 and 600000 ms",
                ));
            }
        }
        Ok(())
    }
}
