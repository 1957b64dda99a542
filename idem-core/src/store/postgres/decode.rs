//! Rows back into records and claim decisions.

use tokio_postgres::Row;

use super::pg_error;
use super::sql::{CLAIM_COLUMN_COUNT, COLUMN_COUNT};
use crate::error::Error;
use crate::key::Fingerprint;
use crate::key_text::Key;
use crate::record::{Meta, Origin, Record, State, Timestamp, Token};

/// The one row of an aggregate's answer.
pub(super) fn one_row(rows: Vec<Row>) -> Result<Row, Error> {
    rows.into_iter()
        .next()
        .ok_or_else(|| pg_error("an aggregate answered no row"))
}

/// What a row of the `read` query holds: the record (`None` if the key has no row) and
/// the database time.
pub(super) fn decode_read(key: &Key, row: &Row) -> Result<(Option<Record>, Timestamp), Error> {
    Ok((decode_row(key, row, 0)?, now_of(row, 0)?))
}

/// The database time in a row that has the columns from `at` on, then the time.
pub(super) fn now_of(row: &Row, at: usize) -> Result<Timestamp, Error> {
    let now: i64 = row.try_get(at + COLUMN_COUNT).map_err(pg_error)?;
    Ok(Timestamp(now.max(0) as u64))
}

/// What a claim decides by, in a row of the claim's read (see [`claim_columns`]): the
/// record, without its metadata (`None` if the key has no row), and the database time.
pub(super) fn decode_claim_read(
    key: &Key,
    row: &Row,
) -> Result<(Option<Record>, Timestamp), Error> {
    let now: i64 = row.try_get(CLAIM_COLUMN_COUNT).map_err(pg_error)?;
    let now = Timestamp(now.max(0) as u64);
    let Some((fingerprint, state)) = decode_decision(key, row, 0)? else {
        return Ok((None, now));
    };
    let expires: i64 = row.try_get(5).map_err(pg_error)?;
    let record = Record {
        fingerprint,
        // Not read: no decision looks at when a record was written, or at its metadata.
        created_at: now,
        expires_at: Timestamp(expires.max(0) as u64),
        state,
        meta: Meta::default(),
    };
    Ok((Some(record), now))
}

/// The fingerprint and state in a row whose columns from `at` on begin as [`columns`]
/// and [`claim_columns`] do, or `None` if the key has no row.
pub(super) fn decode_decision(
    key: &Key,
    row: &Row,
    at: usize,
) -> Result<Option<(Fingerprint, State)>, Error> {
    let corrupt = |reason: String| Error::CorruptRecord {
        key: key.clone(),
        reason,
    };
    let fingerprint: Option<Vec<u8>> = row.try_get(at).map_err(pg_error)?;
    let Some(fingerprint) = fingerprint else {
        return Ok(None);
    };
    let fingerprint: [u8; 32] = fingerprint
        .try_into()
        .map_err(|_| corrupt("fingerprint is not 32 bytes".into()))?;
    let state: i16 = row.try_get(at + 1).map_err(pg_error)?;
    let token: Vec<u8> = row.try_get(at + 2).map_err(pg_error)?;
    let token: [u8; 16] = token
        .try_into()
        .map_err(|_| corrupt("token is not 16 bytes".into()))?;
    let lease: Option<i64> = row.try_get(at + 3).map_err(pg_error)?;
    let payload: Option<Vec<u8>> = row.try_get(at + 4).map_err(pg_error)?;
    let state = match (state, lease, payload) {
        (0, Some(lease), _) => State::InProgress {
            token: Token(u128::from_be_bytes(token)),
            lease_until: Timestamp(lease.max(0) as u64),
        },
        (1, _, Some(result)) => State::Completed { result },
        (2, _, Some(error)) => State::Failed { error },
        (state, ..) => return Err(corrupt(format!("state {state} with missing fields"))),
    };
    Ok(Some((Fingerprint::from_bytes(fingerprint), state)))
}

/// The record in a row whose columns from `at` on are [`columns`], or `None` if the key
/// has no row.
pub(super) fn decode_row(key: &Key, row: &Row, at: usize) -> Result<Option<Record>, Error> {
    let Some((fingerprint, state)) = decode_decision(key, row, at)? else {
        return Ok(None);
    };
    let get = |i: usize| at + i;
    let created: i64 = row.try_get(get(5)).map_err(pg_error)?;
    let expires: i64 = row.try_get(get(6)).map_err(pg_error)?;
    let text = |i: usize| -> Result<Option<std::sync::Arc<str>>, Error> {
        let value: Option<String> = row.try_get(get(i)).map_err(pg_error)?;
        Ok(value.map(Into::into))
    };
    let (run_id, tenant, call_id, tool) = (text(7)?, text(8)?, text(9)?, text(10)?);
    let time = |i: usize| -> Result<Option<Timestamp>, Error> {
        let ms: Option<i64> = row.try_get(get(i)).map_err(pg_error)?;
        Ok(ms.map(|ms| Timestamp(ms.max(0) as u64)))
    };
    let count = |i: usize| -> Result<u32, Error> {
        let n: i32 = row.try_get(get(i)).map_err(pg_error)?;
        Ok(n.max(0) as u32)
    };
    let at = |ms: i64| Timestamp(ms.max(0) as u64);
    let done = !matches!(state, State::InProgress { .. });
    let origin = match (run_id, tool) {
        (Some(run_id), Some(tool)) => Some(Origin {
            tenant,
            run_id,
            call_id,
            tool,
        }),
        _ => None,
    };
    Ok(Some(Record {
        fingerprint,
        created_at: at(created),
        expires_at: at(expires),
        state,
        meta: Meta {
            origin,
            claimed_at: time(11)?.unwrap_or_default(),
            // A row of idem 0.1 was last written by its completion.
            completed_at: time(12)?.or(done.then(|| at(created))),
            renewed_at: time(13)?,
            attempts: count(14)?,
            takeovers: count(15)?,
        },
    }))
}
