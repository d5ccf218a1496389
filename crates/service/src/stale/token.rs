//! Quote tokens: what one search answer showed for one room type, signed.
//!
//! A token is `base64url(payload ‖ HMAC-SHA256(key, payload)[..16])`, no
//! padding. The tag is truncated to 128 bits (RFC 2104 §5 and NIST SP
//! 800-107 allow it; forging one still takes 2^128 tries per guess) because
//! every room type of every answer carries a token.
//! The payload is a version byte, then the fields below as `postcard`
//! writes them: varints, zigzag for signed fields. A typical token is 38
//! bytes (51 characters) where version 2's fixed-width 48-byte record made
//! 64 (86 characters): a page of 130 room types is 4 kB shorter, and the
//! base64 and JSON work per token shrink with it. A token still costs one
//! HMAC over one SHA-256 block on the hot search path (the keyed state is
//! computed once and cloned per token).
//!
//! ```text
//! version u8 (3) | source u8 | hotel_id i64 | room_type_id i64 | check_in
//! i32 (days from CE) | nights u16 | free_units i32 | lsn u64 | shown_at_ms
//! i64 | lag_ms u32
//! ```
//!
//! The tag is checked (in constant time, by `hmac`) before a single payload
//! field is read, so a forged or altered token is refused without the parser
//! ever seeing attacker-chosen fields. Tokens are not encrypted: what they
//! record is what the answer showed in the clear anyway.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Datelike, NaiveDate, Utc};
use hmac::{Hmac, KeyInit, Mac};
use rand::RngExt;
use sha2::Sha256;

use crate::lsn::Lsn;
use crate::model::Source;

type HmacSha256 = Hmac<Sha256>;

/// Bumped when the payload layout changes; older tokens are then refused
/// (version 2 was a fixed-width 48-byte record).
const VERSION: u8 = 3;
/// The longest payload: the version byte and every field at its longest
/// varint (10 bytes for 64 bits, 5 for 32, 3 for 16).
const MAX_PAYLOAD_LEN: usize = 1 + 1 + 10 + 10 + 5 + 3 + 5 + 10 + 10 + 5;
/// Bytes of the HMAC kept (version 1 kept all 32).
const TAG_LEN: usize = 16;
const MAX_TOKEN_LEN: usize = MAX_PAYLOAD_LEN + TAG_LEN;
/// The version byte and the tag: anything shorter is not a token.
const MIN_TOKEN_LEN: usize = 1 + TAG_LEN;
/// base64url of `MAX_TOKEN_LEN` bytes without padding; anything longer is
/// refused before decoding.
const MAX_ENCODED_LEN: usize = (MAX_TOKEN_LEN * 4).div_ceil(3);
/// Shortest key accepted: a key shorter than the hash output weakens HMAC.
pub const MIN_KEY_BYTES: usize = 32;

/// What one answer showed for one room type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quote {
    pub source: Source,
    pub hotel_id: i64,
    pub room_type_id: i64,
    pub check_in: NaiveDate,
    pub check_out: NaiveDate,
    /// The fewest free units shown over the stay (0 when the room type was
    /// listed but not offered, as `/availability` does).
    pub free_units: i32,
    /// The LSN the answer reflects. For `source = owner` the numbers are
    /// newer; for `source = confirmed` it is the confirmed position (the
    /// answer's `confirmed_lsn`), which the numbers are at or past.
    pub lsn: Lsn,
    /// When the answer was made (ms precision).
    pub shown_at: DateTime<Utc>,
    /// How far behind the owner the copy was when the answer was made.
    pub lag_ms: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuoteError {
    #[error("the quote is not a token this service issued (malformed)")]
    Malformed,
    #[error("the quote's signature does not match (forged or altered)")]
    BadSignature,
    #[error("the quote was issued by an incompatible version")]
    UnknownVersion,
    #[error("the quote's fields are out of range")]
    BadField,
    #[error("a stay of {0} nights cannot be quoted")]
    StayTooLong(i64),
}

/// The signing key, with HMAC's keyed state computed once.
#[derive(Clone)]
pub struct QuoteKey {
    mac: HmacSha256,
}

impl std::fmt::Debug for QuoteKey {
    // Never print key material, not even in a debug dump.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QuoteKey(..)")
    }
}

impl QuoteKey {
    /// A key from configured bytes; the caller checks `MIN_KEY_BYTES`.
    pub fn new(key: &[u8]) -> QuoteKey {
        QuoteKey {
            // HMAC accepts keys of any length (long ones are hashed first).
            mac: HmacSha256::new_from_slice(key).expect("hmac takes any key length"),
        }
    }

    /// A fresh random key: tokens then only verify in this process.
    pub fn random() -> QuoteKey {
        let key: [u8; 32] = rand::rng().random();
        QuoteKey::new(&key)
    }

    pub fn sign(&self, quote: &Quote) -> Result<String, QuoteError> {
        self.sign_token(quote).map(|t| t.as_str().to_owned())
    }

    /// `sign`, into a `Token` held inline.
    pub fn sign_token(&self, quote: &Quote) -> Result<Token, QuoteError> {
        let mut raw = [0u8; MAX_TOKEN_LEN];
        let len = encode_payload(quote, &mut raw[..MAX_PAYLOAD_LEN])?;
        let mut mac = self.mac.clone();
        mac.update(&raw[..len]);
        let full = mac.finalize().into_bytes();
        raw[len..len + TAG_LEN].copy_from_slice(&full[..TAG_LEN]);
        let mut token = Token::default();
        let written = URL_SAFE_NO_PAD
            .encode_slice(&raw[..len + TAG_LEN], &mut token.text)
            .map_err(|_| QuoteError::BadField)?;
        token.len = u8::try_from(written).map_err(|_| QuoteError::BadField)?;
        Ok(token)
    }

    pub fn verify(&self, token: &str) -> Result<Quote, QuoteError> {
        if token.len() > MAX_ENCODED_LEN {
            return Err(QuoteError::Malformed);
        }
        let raw = URL_SAFE_NO_PAD
            .decode(token.as_bytes())
            .map_err(|_| QuoteError::Malformed)?;
        if !(MIN_TOKEN_LEN..=MAX_TOKEN_LEN).contains(&raw.len()) {
            return Err(QuoteError::Malformed);
        }
        let (payload, tag) = raw.split_at(raw.len() - TAG_LEN);
        let mut mac = self.mac.clone();
        mac.update(payload);
        // Constant time: the comparison does not stop at the first wrong byte.
        mac.verify_truncated_left(tag)
            .map_err(|_| QuoteError::BadSignature)?;
        decode_payload(payload)
    }
}

/// A signed token, held inline: an answer carries one per room type shown,
/// and a `String` each was an allocation per room type. Serialized as its
/// text; empty by default (a room type not yet quoted).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Token {
    len: u8,
    text: [u8; MAX_ENCODED_LEN],
}

impl Token {
    pub fn as_str(&self) -> &str {
        // base64url text is ASCII; the empty fallback is never taken.
        std::str::from_utf8(&self.text[..usize::from(self.len)]).unwrap_or_default()
    }
}

impl Default for Token {
    fn default() -> Token {
        Token {
            len: 0,
            text: [0; MAX_ENCODED_LEN],
        }
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for Token {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl Quote {
    /// The stay's length in nights.
    pub fn nights(&self) -> i64 {
        (self.check_out - self.check_in).num_days()
    }
}

/// A quote's fields as the payload carries them, after the version byte.
#[derive(serde::Serialize, serde::Deserialize)]
struct Wire {
    source: u8,
    hotel_id: i64,
    room_type_id: i64,
    /// Days from the common era.
    check_in: i32,
    nights: u16,
    free_units: i32,
    lsn: u64,
    shown_at_ms: i64,
    lag_ms: u32,
}

/// Writes the payload at the start of `buf` (`MAX_PAYLOAD_LEN` bytes) and
/// returns its length.
fn encode_payload(q: &Quote, buf: &mut [u8]) -> Result<usize, QuoteError> {
    debug_assert_eq!(buf.len(), MAX_PAYLOAD_LEN);
    let nights = q.nights();
    let nights = u16::try_from(nights)
        .ok()
        .filter(|n| *n > 0)
        .ok_or(QuoteError::StayTooLong(nights))?;
    let wire = Wire {
        source: source_byte(q.source),
        hotel_id: q.hotel_id,
        room_type_id: q.room_type_id,
        check_in: q.check_in.num_days_from_ce(),
        nights,
        free_units: q.free_units,
        lsn: q.lsn.0,
        shown_at_ms: q.shown_at.timestamp_millis(),
        lag_ms: q.lag_ms,
    };
    let (version, fields) = buf.split_at_mut(1);
    version[0] = VERSION;
    // The buffer holds every field at its longest, so this cannot run short.
    let written = postcard::to_slice(&wire, fields)
        .map_err(|_| QuoteError::BadField)?
        .len();
    Ok(1 + written)
}

fn decode_payload(p: &[u8]) -> Result<Quote, QuoteError> {
    let (&version, fields) = p.split_first().ok_or(QuoteError::Malformed)?;
    if version != VERSION {
        return Err(QuoteError::UnknownVersion);
    }
    let (w, rest) = postcard::take_from_bytes::<Wire>(fields).map_err(|_| QuoteError::BadField)?;
    if !rest.is_empty() {
        return Err(QuoteError::BadField);
    }
    let source = match w.source {
        0 => Source::Copy,
        1 => Source::Owner,
        2 => Source::CopyFallback,
        3 => Source::Confirmed,
        _ => return Err(QuoteError::BadField),
    };
    let check_in = NaiveDate::from_num_days_from_ce_opt(w.check_in).ok_or(QuoteError::BadField)?;
    let check_out = check_in
        .checked_add_days(chrono::Days::new(u64::from(w.nights)))
        .ok_or(QuoteError::BadField)?;
    let shown_at = DateTime::from_timestamp_millis(w.shown_at_ms).ok_or(QuoteError::BadField)?;
    Ok(Quote {
        source,
        hotel_id: w.hotel_id,
        room_type_id: w.room_type_id,
        check_in,
        check_out,
        free_units: w.free_units,
        lsn: Lsn(w.lsn),
        shown_at,
        lag_ms: w.lag_ms,
    })
}

fn source_byte(s: Source) -> u8 {
    match s {
        Source::Copy => 0,
        Source::Owner => 1,
        Source::CopyFallback => 2,
        Source::Confirmed => 3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn quote() -> Quote {
        Quote {
            source: Source::CopyFallback,
            hotel_id: 42,
            room_type_id: -7,
            check_in: NaiveDate::from_ymd_opt(2030, 1, 30).unwrap(),
            check_out: NaiveDate::from_ymd_opt(2030, 2, 2).unwrap(),
            free_units: 3,
            lsn: Lsn(0x1_16B3_0748),
            shown_at: DateTime::from_timestamp_millis(1_900_000_000_123).unwrap(),
            lag_ms: 250,
        }
    }

    #[test]
    fn round_trips_every_field() {
        let key = QuoteKey::new(&[7u8; 32]);
        let token = key.sign(&quote()).unwrap();
        assert_eq!(token.len(), 51, "38 bytes → 51 chars (version 2: 86)");
        assert!(
            token
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        );
        assert_eq!(key.verify(&token), Ok(quote()));
    }

    #[test]
    fn an_inline_token_is_the_same_text() {
        let key = QuoteKey::new(&[7u8; 32]);
        let token = key.sign_token(&quote()).unwrap();
        assert_eq!(token.as_str(), key.sign(&quote()).unwrap());
        assert_eq!(
            serde_json::to_string(&token).unwrap(),
            format!("\"{token}\"")
        );
        assert_eq!(Token::default().as_str(), "");
    }

    #[test]
    fn another_key_refuses_the_token() {
        let token = QuoteKey::new(&[7u8; 32]).sign(&quote()).unwrap();
        assert_eq!(
            QuoteKey::new(&[8u8; 32]).verify(&token),
            Err(QuoteError::BadSignature)
        );
        assert_eq!(
            QuoteKey::random().verify(&token),
            Err(QuoteError::BadSignature)
        );
    }

    #[test]
    fn an_altered_payload_is_refused() {
        let key = QuoteKey::new(&[1u8; 40]);
        let token = key.sign(&quote()).unwrap();
        let mut raw = URL_SAFE_NO_PAD.decode(&token).unwrap();
        // Raise free_units (byte 8, zigzag 3 = 6) the way a tamperer would.
        assert_eq!(raw[8], 6);
        raw[8] = 8;
        let altered = URL_SAFE_NO_PAD.encode(&raw);
        assert_eq!(key.verify(&altered), Err(QuoteError::BadSignature));
    }

    #[test]
    fn garbage_is_malformed_not_a_panic() {
        let key = QuoteKey::random();
        for bad in [
            "",
            "x",
            "!!!!",
            &"A".repeat(86),
            &"A".repeat(107),
            &"A".repeat(5000),
        ] {
            assert!(key.verify(bad).is_err(), "{bad:?} verified");
        }
        assert_eq!(key.verify("not base64 at all"), Err(QuoteError::Malformed));
    }

    #[test]
    fn stays_that_do_not_fit_are_refused_when_signing() {
        let mut q = quote();
        q.check_out = q.check_in;
        assert_eq!(QuoteKey::random().sign(&q), Err(QuoteError::StayTooLong(0)));
    }

    proptest! {
        #[test]
        fn any_single_bit_flip_is_refused(byte in 0usize..MAX_TOKEN_LEN, bit in 0u8..8) {
            let key = QuoteKey::new(b"a key long enough for hmac-sha256!!");
            let token = key.sign(&quote()).unwrap();
            let mut raw = URL_SAFE_NO_PAD.decode(&token).unwrap();
            let at = byte % raw.len();
            raw[at] ^= 1 << bit;
            prop_assert!(key.verify(&URL_SAFE_NO_PAD.encode(&raw)).is_err());
        }

        #[test]
        fn never_panics_on_text(s in "\\PC{0,140}") {
            let _ = QuoteKey::random().verify(&s);
        }

        /// Random bytes of a token's exact length get past the decoding to
        /// the tag check, and fail there: a typed refusal, never a panic.
        #[test]
        fn random_tokens_of_the_right_shape_are_refused(raw in proptest::collection::vec(any::<u8>(), MIN_TOKEN_LEN..=MAX_TOKEN_LEN)) {
            let key = QuoteKey::new(b"a key long enough for hmac-sha256!!");
            prop_assert_eq!(key.verify(&URL_SAFE_NO_PAD.encode(&raw)), Err(QuoteError::BadSignature));
        }

        /// Even a correctly tagged payload of any bytes (another version's,
        /// or a leaked key's) is read without a panic: a quote, or a typed
        /// field or version error.
        #[test]
        fn any_tagged_payload_decodes_or_is_a_typed_error(payload in proptest::collection::vec(any::<u8>(), 1..=MAX_PAYLOAD_LEN)) {
            let key = QuoteKey::new(b"a key long enough for hmac-sha256!!");
            let mut mac = key.mac.clone();
            mac.update(&payload);
            let mut raw = payload.clone();
            raw.extend_from_slice(&mac.finalize().into_bytes()[..TAG_LEN]);
            match key.verify(&URL_SAFE_NO_PAD.encode(&raw)) {
                Ok(_) | Err(QuoteError::UnknownVersion | QuoteError::BadField) => {}
                Err(other) => prop_assert!(false, "unexpected {:?}", other),
            }
        }

        #[test]
        fn round_trips_any_values(
            hotel in any::<i64>(), rt in any::<i64>(), free in any::<i32>(),
            lsn in any::<u64>(), lag in any::<u32>(), nights in 1u64..=400,
            start in 0u64..100_000, ms in 0i64..4_000_000_000_000,
            src in 0u8..4,
        ) {
            let check_in = NaiveDate::from_ymd_opt(2000, 1, 1).unwrap() + chrono::Days::new(start);
            let q = Quote {
                source: [Source::Copy, Source::Owner, Source::CopyFallback, Source::Confirmed][usize::from(src)],
                hotel_id: hotel,
                room_type_id: rt,
                check_in,
                check_out: check_in + chrono::Days::new(nights),
                free_units: free,
                lsn: Lsn(lsn),
                shown_at: DateTime::from_timestamp_millis(ms).unwrap(),
                lag_ms: lag,
            };
            let key = QuoteKey::random();
            prop_assert_eq!(key.verify(&key.sign(&q).unwrap()), Ok(q));
        }
    }
}
