//! What the booking service is told about the contested hotels while the
//! guests race: `/v1/bypass` asked for every hot hotel a few times a second,
//! and how often a hotel's `hotel_conflicts` flag turned on or off. A policy
//! that flaps sends a hotel's takes to the owner and back many times a
//! minute; one that decides from unconfirmed copy showings only should not
//! flag a hotel for races no read could have avoided.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::NaiveDate;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::http_client::HttpClient;

/// What the samples saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BypassSeen {
    /// Rounds of asking every hotel.
    pub rounds: u64,
    /// Hotels flagged `hotel_conflicts` in at least one answer.
    pub flagged: BTreeSet<i64>,
    /// Times a hotel's flag changed between two of its answers.
    pub flips: u64,
    /// Answers that were not a 200 with a `reasons` list.
    pub failed: u64,
}

impl BypassSeen {
    /// Notes one answer for `hotel_id`; `last` holds each hotel's previous flag.
    fn note(&mut self, last: &mut BTreeMap<i64, bool>, hotel_id: i64, flagged: bool) {
        if flagged {
            self.flagged.insert(hotel_id);
        }
        if let Some(before) = last.insert(hotel_id, flagged)
            && before != flagged
        {
            self.flips += 1;
        }
    }
}

/// Whether an answer of `/v1/bypass` names `hotel_conflicts`; `None` when it
/// is not an answer of that shape.
fn hotel_conflicts(answer: &Value) -> Option<bool> {
    let reasons = answer["reasons"].as_array()?;
    Some(reasons.iter().any(|r| r == "hotel_conflicts"))
}

/// Asks `/v1/bypass` for room type 1 of every hotel in `hotel_ids`, for one
/// room on the first night, every `every`, until `stop`.
pub async fn watch(
    http: HttpClient,
    hotel_ids: Vec<i64>,
    first_night: NaiveDate,
    every: Duration,
    stop: CancellationToken,
) -> BypassSeen {
    let mut seen = BypassSeen::default();
    let mut last = BTreeMap::new();
    let check_out = first_night + chrono::Days::new(1);
    while !stop.is_cancelled() {
        for &hotel_id in &hotel_ids {
            let path = format!(
                "/v1/bypass?hotel_id={hotel_id}&room_type_id=1&check_in={first_night}&check_out={check_out}&rooms=1"
            );
            let flagged = match http.get(&path).await {
                Ok(r) if r.status == 200 => hotel_conflicts(&r.json()),
                _ => None,
            };
            match flagged {
                Some(flagged) => seen.note(&mut last, hotel_id, flagged),
                None => seen.failed += 1,
            }
        }
        seen.rounds += 1;
        tokio::select! {
            () = stop.cancelled() => {}
            () = tokio::time::sleep(every) => {}
        }
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn flips_count_changes_of_one_hotel_not_differences_between_hotels() {
        let mut seen = BypassSeen::default();
        let mut last = BTreeMap::new();
        // Hotel 1 is flagged throughout, hotel 2 never: no flip.
        for _ in 0..3 {
            seen.note(&mut last, 1, true);
            seen.note(&mut last, 2, false);
        }
        assert_eq!(seen.flips, 0);
        // Hotel 2 turns on, then off again: two flips.
        seen.note(&mut last, 2, true);
        seen.note(&mut last, 2, false);
        assert_eq!(seen.flips, 2);
        assert_eq!(seen.flagged, BTreeSet::from([1, 2]));
    }

    #[test]
    fn only_hotel_conflicts_counts_as_the_flag() {
        let few = json!({"bypass": true, "reasons": ["few_units"]});
        let both = json!({"bypass": true, "reasons": ["few_units", "hotel_conflicts"]});
        assert_eq!(hotel_conflicts(&few), Some(false));
        assert_eq!(hotel_conflicts(&both), Some(true));
        assert_eq!(hotel_conflicts(&json!({"type": "/problems/x"})), None);
    }
}
