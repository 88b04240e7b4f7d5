//! The value of one record in Redis: a single string, so that `SET … NX PX … GET` can create
//! it or return it in one plain command.
//!
//! Layout (integers big-endian):
//!
//! ```text
//! u8   format            2 (format 1 was a hash, see the crate's CHANGELOG)
//! u8   state             b'i' in flight, b'c' completed, b'a' an abandoned token's marker
//! [32] fingerprint
//! u8   token length
//!      token
//! --- completed records only, format 2:
//! u64  expires at        Unix time in milliseconds (for the replay cache)
//!      the encoded StoredResponse (its own version byte first)
//! ```
//!
//! The marker of abandoned tokens is the header of the latest, its fingerprint all zeros,
//! followed by the token fields (length, then bytes) of up to
//! [`REMEMBERED_TOKENS`]` - 1` tokens abandoned on the key before it, latest first.
//!
//! An in-flight record written over another token's marker (the library's `claim`) carries
//! that marker after its token, for its release to put back:
//!
//! ```text
//! u64  the marker's expiry   Unix time in milliseconds (the server's clock)
//!      the marker, whole
//! ```
//!
//! The header up to the token is the same in every format, present and future: any version
//! can tell an in-flight record from a completed one, compare its fingerprint and check a
//! token, so instances of two versions sharing Redis never take each other's keys. Only
//! what follows the token may change with the format.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix_web::web::Bytes;

use crate::fingerprint::Fingerprint;
use crate::record::{RecordError, StoredResponse};
use crate::store::LeaseToken;

/// The format this version writes.
pub(super) const FORMAT: u8 = 2;
/// State byte of an in-flight record.
pub(super) const IN_FLIGHT: u8 = b'i';
/// State byte of a completed record.
pub(super) const COMPLETED: u8 = b'c';
/// State byte of the marker abandoned tokens leave.
pub(super) const ABANDONED: u8 = b'a';
/// How many abandoned tokens one marker remembers; an older one is forgotten (its late
/// `begin`, if it ever lands, finds the key taken by the marker all the same).
pub(super) const REMEMBERED_TOKENS: usize = 16;
/// The bytes of the earlier tokens a marker keeps: `REMEMBERED_TOKENS - 1` fields of a
/// generated (32-character) token.
pub(super) const REMEMBERED_TAIL: usize = (REMEMBERED_TOKENS - 1) * 33;
/// Where the token's length byte is (0-based); the functions compare from here.
pub(super) const TOKEN_OFFSET: usize = 34;

/// The in-flight record `begin` writes: the header alone.
pub(super) fn in_flight(fingerprint: &Fingerprint, token: &LeaseToken) -> Vec<u8> {
    let mut record = Vec::with_capacity(TOKEN_OFFSET + 1 + token.as_bytes().len());
    record.push(FORMAT);
    record.push(IN_FLIGHT);
    record.extend_from_slice(fingerprint.as_bytes());
    push_token_field(&mut record, token);
    record
}

/// The marker `abandon` writes for `token` (the function appends the tokens of a marker
/// already there): the header of state `a`, with no fingerprint.
pub(super) fn abandoned(token: &LeaseToken) -> Vec<u8> {
    let mut marker = in_flight(&Fingerprint::from_bytes([0; 32]), token);
    marker[1] = ABANDONED;
    marker
}

/// The token as records hold it: its length, then its bytes (what the functions compare).
pub(super) fn token_field(token: &LeaseToken) -> Vec<u8> {
    let mut field = Vec::with_capacity(1 + token.as_bytes().len());
    push_token_field(&mut field, token);
    field
}

/// Appends the token field of `token` to `out`.
fn push_token_field(out: &mut Vec<u8>, token: &LeaseToken) {
    let token = token.as_bytes();
    // Tokens are 32 characters; a longer one (never generated) is cut to stay readable.
    let token = &token[..token.len().min(usize::from(u8::MAX))];
    out.push(token.len() as u8);
    out.extend_from_slice(token);
}

/// The completed record of the request whose `in_flight` record this is: the same header
/// in state `c`, then the completion (expiry and response).
pub(super) fn completed(in_flight: &[u8], response: &StoredResponse, ttl: Duration) -> Vec<u8> {
    let expires_at = unix_millis(SystemTime::now()).saturating_add(millis(ttl));
    let mut record = Vec::with_capacity(in_flight.len() + 8 + response.encoded_len());
    record.extend_from_slice(in_flight);
    record[1] = COMPLETED;
    record.extend_from_slice(&expires_at.to_be_bytes());
    response.encode_into(&mut record);
    record
}

/// Whether `found` is the record `in_flight` written over another token's marker, which it
/// carries after its token (see the module's docs). Never panics, whatever the bytes.
pub(super) fn took_over_a_marker(found: &[u8], in_flight: &[u8]) -> bool {
    found.len() > in_flight.len() + 8 && found.starts_with(in_flight)
}

/// A record as `begin` finds it.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Found<'a> {
    /// In flight, held by `token`.
    InFlight {
        fingerprint: &'a [u8],
        token: &'a [u8],
    },
    /// Completed: its format, and where the bytes after the token start.
    Completed {
        fingerprint: &'a [u8],
        format: u8,
        tail_start: usize,
    },
    /// The marker of abandoned tokens: their token fields, latest first.
    Abandoned { tokens: &'a [u8] },
}

impl<'a> Found<'a> {
    /// Reads the header of a record; never panics, whatever the bytes.
    pub(super) fn read(record: &'a [u8]) -> Result<Self, RecordError> {
        if record.len() <= TOKEN_OFFSET {
            return Err(RecordError::Truncated);
        }
        let (format, state) = (record[0], record[1]);
        let fingerprint = &record[2..TOKEN_OFFSET];
        let token_len = usize::from(record[TOKEN_OFFSET]);
        let rest = &record[TOKEN_OFFSET + 1..];
        if rest.len() < token_len {
            return Err(RecordError::Truncated);
        }
        let token = &rest[..token_len];
        match state {
            IN_FLIGHT => Ok(Self::InFlight { fingerprint, token }),
            ABANDONED => Ok(Self::Abandoned {
                tokens: &record[TOKEN_OFFSET..],
            }),
            COMPLETED => Ok(Self::Completed {
                fingerprint,
                format,
                tail_start: TOKEN_OFFSET + 1 + token_len,
            }),
            _ => Err(RecordError::Invalid("record state")),
        }
    }
}

/// Whether `record` is completed and holds `token`: what a commit that wrote nothing finds when
/// an earlier send of the same commit (its reply lost) completed the record. Never panics,
/// whatever the bytes.
pub(super) fn completed_by(record: &[u8], token: &LeaseToken) -> bool {
    record.get(1) == Some(&COMPLETED)
        && record
            .get(TOKEN_OFFSET..)
            .is_some_and(|rest| rest.starts_with(&token_field(token)))
}

/// Whether the token fields of a marker (see [`Found::Abandoned`]) hold `token`; a field cut
/// short at the end is ignored.
pub(super) fn remembers(mut tokens: &[u8], token: &LeaseToken) -> bool {
    let token = token.as_bytes();
    while let Some((&len, rest)) = tokens.split_first() {
        let Some((field, rest)) = rest.split_at_checked(usize::from(len)) else {
            return false;
        };
        if field == token {
            return true;
        }
        tokens = rest;
    }
    false
}

/// Decodes the tail of a completed record of `format` (the bytes after its token, shared
/// with the reply they came in): the response, whose body is a slice of `tail`, and how much
/// longer it is kept (zero once its expiry has passed).
pub(super) fn decode_completion(
    format: u8,
    tail: Bytes,
) -> Result<(StoredResponse, Duration), RecordError> {
    if format != FORMAT {
        return Err(RecordError::UnsupportedVersion(format));
    }
    let Some((expires_at, _)) = tail.split_first_chunk::<8>() else {
        return Err(RecordError::Truncated);
    };
    let remaining = u64::from_be_bytes(*expires_at).saturating_sub(unix_millis(SystemTime::now()));
    Ok((
        StoredResponse::decode_shared(tail.slice(8..))?,
        Duration::from_millis(remaining),
    ))
}

fn unix_millis(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map_or(0, millis)
}

/// Whole milliseconds, at least 1 (Redis refuses an expiry of 0), saturating.
pub(super) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

#[cfg(test)]
mod tests {
    use actix_web::http::StatusCode;
    use actix_web::web::Bytes;

    use super::*;

    fn response() -> StoredResponse {
        StoredResponse {
            status: StatusCode::CREATED,
            headers: Vec::new(),
            body: Some(Bytes::from_static(b"{}")),
        }
    }

    #[test]
    fn an_in_flight_record_reads_back_its_fingerprint_and_token() {
        let print = Fingerprint::from_bytes([7; 32]);
        let token = LeaseToken::generate();
        let record = in_flight(&print, &token);
        assert_eq!(
            Found::read(&record),
            Ok(Found::InFlight {
                fingerprint: &[7; 32],
                token: token.as_bytes()
            })
        );
    }

    #[test]
    fn only_a_completed_record_of_the_token_is_completed_by_it() {
        let print = Fingerprint::from_bytes([7; 32]);
        let (mine, theirs) = (LeaseToken::generate(), LeaseToken::generate());
        let in_flight_record = in_flight(&print, &mine);
        let completed_record = completed(&in_flight_record, &response(), Duration::from_secs(9));
        assert!(completed_by(&completed_record, &mine));
        assert!(!completed_by(&completed_record, &theirs));
        assert!(!completed_by(&in_flight_record, &mine));
        assert!(!completed_by(&abandoned(&mine), &mine));
        for cut in 0..TOKEN_OFFSET + 2 {
            assert!(!completed_by(&completed_record[..cut], &mine));
        }
    }

    #[test]
    fn a_completed_record_is_the_in_flight_header_then_its_completion() {
        let print = Fingerprint::from_bytes([1; 32]);
        let token = LeaseToken::generate();
        // What `commit` sends and writes: the header in state `c`, then the completion.
        let header = in_flight(&print, &token);
        let record = completed(&header, &response(), Duration::from_secs(60));
        assert_eq!(record[1], COMPLETED);
        assert_eq!(record[2..header.len()], header[2..]);
        let Ok(Found::Completed {
            fingerprint,
            format,
            tail_start,
        }) = Found::read(&record)
        else {
            panic!("not completed: {record:?}");
        };
        assert_eq!(fingerprint, &[1; 32]);
        let tail = Bytes::from(record.clone()).slice(tail_start..);
        let (decoded, remaining) = decode_completion(format, tail).unwrap();
        assert_eq!(decoded, response());
        assert!(remaining <= Duration::from_secs(60) && remaining > Duration::from_secs(50));
    }

    #[test]
    fn a_marker_remembers_every_token_it_lists() {
        let (latest, earlier, other) = (
            LeaseToken::generate(),
            LeaseToken::generate(),
            LeaseToken::generate(),
        );
        // What the abandon function writes over an earlier marker.
        let mut marker = abandoned(&latest);
        marker.extend_from_slice(&token_field(&earlier));
        let Ok(Found::Abandoned { tokens }) = Found::read(&marker) else {
            panic!("not a marker");
        };
        assert!(remembers(tokens, &latest) && remembers(tokens, &earlier));
        assert!(!remembers(tokens, &other));
        // A field cut short (the function bounds the marker by bytes) is ignored.
        assert!(!remembers(&tokens[..tokens.len() - 1], &earlier));
        assert_eq!(
            REMEMBERED_TAIL,
            (REMEMBERED_TOKENS - 1) * token_field(&other).len()
        );
    }

    #[test]
    fn another_format_is_still_read_up_to_its_token() {
        let token = LeaseToken::generate();
        let mut record = in_flight(&Fingerprint::from_bytes([2; 32]), &token);
        record[0] = 99;
        record.extend_from_slice(b"whatever a later format adds");
        assert!(matches!(Found::read(&record), Ok(Found::InFlight { .. })));
        record[1] = COMPLETED;
        let Ok(Found::Completed {
            format, tail_start, ..
        }) = Found::read(&record)
        else {
            panic!("not completed");
        };
        assert_eq!(
            decode_completion(format, Bytes::from(record).slice(tail_start..)),
            Err(RecordError::UnsupportedVersion(99))
        );
    }

    #[test]
    fn every_truncation_and_unknown_state_is_an_error_not_a_panic() {
        let header = in_flight(&Fingerprint::from_bytes([3; 32]), &LeaseToken::generate());
        let mut record = completed(&header, &response(), Duration::from_secs(1));
        for len in 0..record.len() {
            if let Ok(Found::Completed {
                format, tail_start, ..
            }) = Found::read(&record[..len])
            {
                let _ = decode_completion(format, Bytes::copy_from_slice(&record[tail_start..len]));
            }
        }
        assert_eq!(Found::read(&record[..10]), Err(RecordError::Truncated));
        record[1] = b'x';
        assert_eq!(
            Found::read(&record),
            Err(RecordError::Invalid("record state"))
        );
    }
}
