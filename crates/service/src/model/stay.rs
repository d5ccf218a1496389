//! A stay: the nights a guest asks about. Search parses it, the calendars
//! fold over it, and the stale-read loop keys take outcomes by it.

use chrono::NaiveDate;

/// The nights `[check_in, check_out)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stay {
    pub check_in: NaiveDate,
    pub check_out: NaiveDate,
}

impl Stay {
    pub fn nights(&self) -> impl Iterator<Item = NaiveDate> {
        self.check_in
            .iter_days()
            .take_while(move |d| *d < self.check_out)
    }

    pub fn len(&self) -> i64 {
        (self.check_out - self.check_in).num_days()
    }

    pub fn is_empty(&self) -> bool {
        self.len() <= 0
    }
}
