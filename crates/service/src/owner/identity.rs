//! Which owner the copy follows: the cluster's system identifier and the
//! timeline its primary writes on.
//!
//! Why it matters: an LSN names a WAL record only within one cluster and
//! one timeline. When the owner's standby is promoted (PostgreSQL 15 does
//! not carry logical slots to it) the new primary writes a new timeline
//! that branched off where the standby stood, possibly below positions the
//! copy already applied from the old primary. So every replication session
//! reads `IDENTIFY_SYSTEM` and reports it here (`OwnerPin::observe`); a
//! change is a new owner, and the projector takes a new snapshot of it.
//!
//! And with a multi-host `owner.url` (`target_session_attrs=read-write`)
//! each connection picks its host on its own, so an ordinary connection
//! (owner reads, the audit, confirmed reads' positions, the refresher, the
//! heartbeat, the slot watch, a replica's polls) could land on another
//! primary than the stream's, whose positions mean nothing to the copy.
//! `owner::connect_configured` therefore checks each new connection against
//! the pinned identity and refuses one that reached another cluster or
//! timeline (`OwnerError::OtherServer`); its caller drops it and retries,
//! as after any failed connect.
//!
//! An ordinary connection cannot run `IDENTIFY_SYSTEM`. Its timeline is read
//! from the name of the WAL file being written (`pg_walfile_name`, which
//! uses the timeline WAL is inserted on), not from `pg_control_checkpoint()`:
//! a promoted standby's checkpoint timeline stays the old one until its
//! first checkpoint after the promotion, which may be minutes away. On a
//! server in recovery the read fails, so a standby is refused too.

use std::fmt;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use serde::Serialize;

/// A cluster and the timeline its primary writes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, utoipa::ToSchema)]
pub struct OwnerIdentity {
    /// `IDENTIFY_SYSTEM`'s `systemid` (a promoted standby keeps it).
    #[schema(value_type = String)]
    #[serde(serialize_with = "as_text")]
    pub system_identifier: u64,
    pub timeline: u32,
}

/// JSON numbers lose precision past 2^53; a system identifier is 64 bits.
fn as_text<S: serde::Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

impl fmt::Display for OwnerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "system {} timeline {}",
            self.system_identifier, self.timeline
        )
    }
}

/// What a session's `IDENTIFY_SYSTEM` said, against what came before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    /// The first session of this process.
    First,
    Same,
    /// Another cluster or timeline: a new owner.
    Changed {
        from: OwnerIdentity,
    },
}

/// The owner the replication stream is on, shared by every connection of
/// one service (it rides in `OwnerSettings`, which every part clones).
#[derive(Debug, Default)]
pub struct OwnerPin {
    state: Mutex<PinState>,
}

#[derive(Debug, Default, Clone)]
struct PinState {
    current: Option<OwnerIdentity>,
    /// Whether a replication session of this process stands on `current`
    /// (`observe`) or stopped streaming since (`release`).
    held: bool,
    previous: Option<OwnerIdentity>,
    changed_at: Option<DateTime<Utc>>,
    changes: u64,
}

/// `/v1/status` `owner`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct OwnerReport {
    /// The owner the replication stream is on, or was last on (a standby
    /// projector's connections are no longer held to it); null before the
    /// first session.
    pub current: Option<OwnerIdentity>,
    /// The one before the last change, if any.
    pub previous: Option<OwnerIdentity>,
    /// When this process last saw the owner change (a failover, or another cluster).
    pub changed_at: Option<DateTime<Utc>>,
    /// Owner changes seen since the start.
    pub changes: u64,
}

impl OwnerPin {
    /// The owner every connection must reach, while a replication session
    /// of this process stands on it.
    pub fn current(&self) -> Option<OwnerIdentity> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.held { state.current } else { None }
    }

    /// This process stopped streaming (a fleet projector that lost the slot
    /// stands by): no session says which owner is current any more, so
    /// connections are no longer held to the last one. Held, the pin
    /// refused every connection once the owner failed over, until a
    /// restart: the standby could never see the slot free, nor bootstrap
    /// its copy of the new timeline. The last owner seen stays, for
    /// `/v1/status` and for the next session to tell a change.
    pub fn release(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).held = false;
    }

    /// Notes the identity a replication session reported; from now on
    /// ordinary connections must reach it.
    pub fn observe(&self, seen: OwnerIdentity) -> Observed {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let observed = match state.current {
            None => Observed::First,
            Some(current) if current == seen => Observed::Same,
            Some(current) => Observed::Changed { from: current },
        };
        if let Observed::Changed { from } = observed {
            state.previous = Some(from);
            state.changed_at = Some(Utc::now());
            state.changes += 1;
        }
        state.current = Some(seen);
        state.held = true;
        observed
    }

    pub fn report(&self) -> OwnerReport {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner()).clone();
        OwnerReport {
            current: state.current,
            previous: state.previous,
            changed_at: state.changed_at,
            changes: state.changes,
        }
    }
}

/// The identity of the server at the far end of an ordinary connection
/// (the module doc says why the timeline comes from the WAL file name).
/// Fails on a server in recovery.
pub async fn read(client: &tokio_postgres::Client) -> Result<OwnerIdentity, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT s.system_identifier,
                    ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int
             FROM pg_control_system() s",
            &[],
        )
        .await?;
    let system_identifier: i64 = row.get(0);
    let timeline: i32 = row.get(1);
    Ok(OwnerIdentity {
        // The control file's u64, which PostgreSQL shows as a signed bigint.
        system_identifier: system_identifier as u64,
        timeline: u32::try_from(timeline).unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(system_identifier: u64, timeline: u32) -> OwnerIdentity {
        OwnerIdentity {
            system_identifier,
            timeline,
        }
    }

    #[test]
    fn a_new_timeline_or_cluster_is_a_change_and_is_reported() {
        let pin = OwnerPin::default();
        assert_eq!(pin.current(), None);
        assert_eq!(pin.observe(id(7, 1)), Observed::First);
        assert_eq!(pin.observe(id(7, 1)), Observed::Same);
        assert_eq!(pin.report().changes, 0);
        assert_eq!(pin.observe(id(7, 2)), Observed::Changed { from: id(7, 1) });
        assert_eq!(pin.current(), Some(id(7, 2)));
        assert_eq!(pin.observe(id(9, 2)), Observed::Changed { from: id(7, 2) });
        let report = pin.report();
        assert_eq!(report.changes, 2);
        assert_eq!(report.previous, Some(id(7, 2)));
        assert!(report.changed_at.is_some());
        // Released (the session stopped): no connection is held to it, and
        // the next session still tells a change from the last owner seen.
        pin.release();
        assert_eq!(pin.current(), None);
        assert_eq!(pin.report().current, Some(id(9, 2)));
        assert_eq!(pin.observe(id(9, 3)), Observed::Changed { from: id(9, 2) });
        assert_eq!(pin.current(), Some(id(9, 3)));
        // 64-bit identifiers go out as text, not as a lossy JSON number.
        let json = serde_json::to_value(id(u64::MAX, 3)).unwrap();
        assert_eq!(json["system_identifier"], "18446744073709551615");
    }
}
