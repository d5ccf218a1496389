//! `RoomTypes`: the copy's room types, grouped by hotel.
//!
//! Every reader asks for one hotel's room types at a time (search for each
//! candidate hotel, availability and the events page for one hotel), so
//! they are kept as a short id-sorted vector per hotel: one map lookup and
//! one contiguous run, where a map keyed by (hotel, room type) cost a tree
//! walk per hotel and a scan of every room type for a single hotel's page.
//!
//! Each hotel's vector sits behind an `Arc`: the copy is published whole
//! after every transaction (`ReadModel`), and a clone must share the
//! vectors, copying only the hotel whose room types a transaction changed.

use std::collections::HashMap;
use std::sync::Arc;

use super::{CalendarKey, RoomType};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoomTypes {
    /// Sorted by room type id; a hotel with none has no entry.
    by_hotel: HashMap<i64, HotelRoomTypes, rustc_hash::FxBuildHasher>,
    len: usize,
}

/// What ranking reads of a room type: its id and its beds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beds {
    pub id: i64,
    pub max_guests: i16,
}

/// One hotel's room types, and their `Beds` beside them in the same order.
/// Ranking reads every candidate hotel's room types for those two fields
/// alone: 16 bytes a room type in a slice the map's slot points at
/// directly, where walking the `RoomType`s (48 bytes each, behind the
/// `Arc` and then the vector) took three times the cache lines and one more
/// dependent load per hotel. Rebuilt on the rare writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct HotelRoomTypes {
    beds: Arc<[Beds]>,
    types: Arc<Vec<RoomType>>,
}

impl HotelRoomTypes {
    fn rebuild_beds(&mut self) {
        self.beds = self
            .types
            .iter()
            .map(|rt| Beds {
                id: rt.id,
                max_guests: rt.max_guests,
            })
            .collect();
    }
}

impl RoomTypes {
    /// One hotel's room types, in id order.
    pub fn of_hotel(&self, hotel_id: i64) -> &[RoomType] {
        self.by_hotel
            .get(&hotel_id)
            .map_or(&[], |h| h.types.as_slice())
    }

    /// One hotel's room types' ids and beds, in id order (as `of_hotel`).
    pub fn beds_of_hotel(&self, hotel_id: i64) -> &[Beds] {
        self.by_hotel.get(&hotel_id).map_or(&[], |h| &h.beds)
    }

    pub fn get(&self, key: &CalendarKey) -> Option<&RoomType> {
        let types = self.of_hotel(key.hotel_id);
        let at = types
            .binary_search_by_key(&key.room_type_id, |rt| rt.id)
            .ok()?;
        Some(&types[at])
    }

    pub fn contains_key(&self, key: &CalendarKey) -> bool {
        self.get(key).is_some()
    }

    /// Adds or replaces the room type at `key`; returns the one replaced.
    pub fn insert(&mut self, key: CalendarKey, room_type: RoomType) -> Option<RoomType> {
        let hotel = self.by_hotel.entry(key.hotel_id).or_default();
        let types = Arc::make_mut(&mut hotel.types);
        let replaced = match types.binary_search_by_key(&key.room_type_id, |rt| rt.id) {
            Ok(at) => Some(std::mem::replace(&mut types[at], room_type)),
            Err(at) => {
                types.insert(at, room_type);
                self.len += 1;
                None
            }
        };
        hotel.rebuild_beds();
        replaced
    }

    pub fn remove(&mut self, key: &CalendarKey) -> Option<RoomType> {
        let hotel = self.by_hotel.get_mut(&key.hotel_id)?;
        let at = hotel
            .types
            .binary_search_by_key(&key.room_type_id, |rt| rt.id)
            .ok()?;
        let types = Arc::make_mut(&mut hotel.types);
        let removed = types.remove(at);
        if types.is_empty() {
            self.by_hotel.remove(&key.hotel_id);
        } else {
            hotel.rebuild_beds();
        }
        self.len -= 1;
        Some(removed)
    }

    pub fn clear(&mut self) {
        self.by_hotel.clear();
        self.len = 0;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every room type, hotel by hotel in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &RoomType> {
        self.by_hotel.values().flat_map(|h| h.types.iter())
    }

    pub fn keys(&self) -> impl Iterator<Item = CalendarKey> + '_ {
        self.values().map(|rt| CalendarKey {
            hotel_id: rt.hotel_id,
            room_type_id: rt.id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn rt(hotel_id: i64, id: i64, max_guests: i16) -> RoomType {
        RoomType {
            hotel_id,
            id,
            name: format!("{hotel_id}/{id}"),
            max_guests,
        }
    }

    proptest! {
        /// Answers like the map keyed by (hotel, room type) it replaced.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec((any::<bool>(), 0i64..4, 0i64..6, 1i16..5), 0..150)) {
            let mut types = RoomTypes::default();
            let mut map: BTreeMap<CalendarKey, RoomType> = BTreeMap::new();
            for (insert, h, id, beds) in ops {
                let key = CalendarKey { hotel_id: h, room_type_id: id };
                if insert {
                    prop_assert_eq!(types.insert(key, rt(h, id, beds)), map.insert(key, rt(h, id, beds)));
                } else {
                    prop_assert_eq!(types.remove(&key), map.remove(&key));
                }
            }
            prop_assert_eq!(types.len(), map.len());
            for h in 0..4 {
                let want: Vec<&RoomType> = map.values().filter(|r| r.hotel_id == h).collect();
                let got: Vec<&RoomType> = types.of_hotel(h).iter().collect();
                let beds: Vec<Beds> = want.iter().map(|r| Beds { id: r.id, max_guests: r.max_guests }).collect();
                prop_assert_eq!(got, want);
                prop_assert_eq!(types.beds_of_hotel(h), &beds[..]);
            }
            let mut keys: Vec<CalendarKey> = types.keys().collect();
            keys.sort();
            prop_assert_eq!(keys, map.keys().copied().collect::<Vec<_>>());
        }
    }
}
