//! Rows back into records and claim decisions.

use tokio_postgres::types::{accepts, FromSql, Type};
use tokio_postgres::Row;

use super::pg_error;
use super::sql::{CLAIM_COLUMN_COUNT, COLUMN_COUNT};
use crate::error::Error;
use crate::key::Fingerprint;
use crate::key_text::Key;
use crate::record::{Meta, Origin, Record, State, Timestamp, Token};

/// The latest time a row reads as: about 285,000 years from 1970.
const MAX_MS: u64 = 9_000_000_000_000_000;

/// Microseconds from the Unix epoch to Postgres's, 2000-01-01 UTC.
const POSTGRES_EPOCH_US: i128 = 946_684_800_000_000;

/// A `timestamptz` column, read on the client from its binary form (microseconds since
/// 2000-01-01 UTC) into milliseconds since the Unix epoch, rounded to the nearest: a
/// time before 1970 reads as 0, and one past [`MAX_MS`] (`infinity`, written by hand) as
/// [`MAX_MS`].
///
/// The statements send the column as it is stored. Converted on the server
/// (`extract(epoch from …)`, which works in `numeric`), the three times a claim reads
/// cost a hit a sixth of its statement's server time.
struct Time(Timestamp);

impl<'a> FromSql<'a> for Time {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Time, Box<dyn std::error::Error + Sync + Send>> {
        let raw: [u8; 8] = raw
            .try_into()
            .map_err(|_| format!("a timestamptz of {} bytes, not 8", raw.len()))?;
        let micros = i128::from(i64::from_be_bytes(raw)) + POSTGRES_EPOCH_US;
        let ms = u64::try_from((micros + 500).div_euclid(1000)).unwrap_or(0);
        Ok(Time(Timestamp(ms.min(MAX_MS))))
    }

    accepts!(TIMESTAMPTZ);
}

/// The time in column `i` of `row` (see [`Time`]), or `None` if it is NULL.
fn time(row: &Row, i: usize) -> Result<Option<Timestamp>, Error> {
    let time: Option<Time> = row.try_get(i).map_err(pg_error)?;
    Ok(time.map(|time| time.0))
}

/// The time in column `i` of `row`, which is never NULL (see [`Time`]).
fn time_of(row: &Row, i: usize) -> Result<Timestamp, Error> {
    let time: Time = row.try_get(i).map_err(pg_error)?;
    Ok(time.0)
}

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
    time_of(row, at + COLUMN_COUNT)
}

/// What a claim decides by, in a row of the claim's read (see
/// [`CLAIM_COLUMNS`](super::sql::CLAIM_COLUMNS)): the record, without its metadata
/// (`None` if the key has no row), and the database time.
pub(super) fn decode_claim_read(
    key: &Key,
    row: &Row,
) -> Result<(Option<Record>, Timestamp), Error> {
    let now = time_of(row, CLAIM_COLUMN_COUNT)?;
    let Some((fingerprint, state)) = decode_decision(key, row, 0)? else {
        return Ok((None, now));
    };
    let record = Record {
        fingerprint,
        // Not read: no decision looks at when a record was written, or at its metadata.
        created_at: now,
        expires_at: time_of(row, 5)?,
        state,
        meta: Meta::default(),
    };
    Ok((Some(record), now))
}

/// The fingerprint and state in a row whose columns from `at` on begin as
/// [`COLUMNS`](super::sql::COLUMNS) and [`CLAIM_COLUMNS`](super::sql::CLAIM_COLUMNS) do,
/// or `None` if the key has no row.
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
    let lease = time(row, at + 3)?;
    let payload: Option<Vec<u8>> = row.try_get(at + 4).map_err(pg_error)?;
    let state = match (state, lease, payload) {
        (0, Some(lease), _) => State::InProgress {
            token: Token(u128::from_be_bytes(token)),
            lease_until: lease,
        },
        (1, _, Some(result)) => State::Completed { result },
        (2, _, Some(error)) => State::Failed { error },
        (state, ..) => return Err(corrupt(format!("state {state} with missing fields"))),
    };
    Ok(Some((Fingerprint::from_bytes(fingerprint), state)))
}

/// The record in a row whose columns from `at` on are [`COLUMNS`](super::sql::COLUMNS),
/// or `None` if the key has no row.
pub(super) fn decode_row(key: &Key, row: &Row, at: usize) -> Result<Option<Record>, Error> {
    let Some((fingerprint, state)) = decode_decision(key, row, at)? else {
        return Ok(None);
    };
    let get = |i: usize| at + i;
    let created = time_of(row, get(5))?;
    let text = |i: usize| -> Result<Option<std::sync::Arc<str>>, Error> {
        let value: Option<String> = row.try_get(get(i)).map_err(pg_error)?;
        Ok(value.map(Into::into))
    };
    let (run_id, tenant, call_id, tool) = (text(7)?, text(8)?, text(9)?, text(10)?);
    let count = |i: usize| -> Result<u32, Error> {
        let n: i32 = row.try_get(get(i)).map_err(pg_error)?;
        Ok(n.max(0) as u32)
    };
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
        created_at: created,
        expires_at: time_of(row, get(6))?,
        state,
        meta: Meta {
            origin,
            claimed_at: time(row, get(11))?.unwrap_or_default(),
            // A row of idem 0.1 was last written by its completion.
            completed_at: time(row, get(12))?.or(done.then_some(created)),
            renewed_at: time(row, get(13))?,
            attempts: count(14)?,
            takeovers: count(15)?,
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Postgres's binary `timestamptz` of `micros` since 2000, read.
    fn read(micros: i64) -> u64 {
        let time = Time::from_sql(&Type::TIMESTAMPTZ, &micros.to_be_bytes()).expect("8 bytes");
        time.0 .0
    }

    #[test]
    fn times_read_as_milliseconds_since_1970_rounded_and_bounded() {
        let unix_epoch = -POSTGRES_EPOCH_US as i64;
        assert_eq!(read(unix_epoch), 0);
        assert_eq!(read(unix_epoch + 1_499), 1);
        assert_eq!(read(unix_epoch + 1_500), 2);
        assert_eq!(read(0), 946_684_800_000);
        // Before 1970, and `-infinity`; `infinity`.
        assert_eq!(read(unix_epoch - 1_000_000), 0);
        assert_eq!(read(i64::MIN), 0);
        assert_eq!(read(i64::MAX), MAX_MS);
        assert!(Time::from_sql(&Type::TIMESTAMPTZ, &[0; 7]).is_err());
    }

    /// The client reads each time as the server converted it before the statements sent
    /// times as stored (`extract(epoch …)`, rounded to the millisecond, bounded).
    #[tokio::test]
    async fn times_read_as_the_server_converted_them() {
        let Some(url) = crate::store::net::test_server("IDEM_POSTGRES_URL") else {
            return;
        };
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        let times = "now(), now() + interval '0.0005 s', now() + interval '0.0015 s', \
             '1970-01-01 00:00:00.0005+00', '1970-01-01 00:00:00.0004+00', \
             '1969-12-31 23:59:59+00', '2000-01-01 00:00:00+00', '2262-04-11 23:47:16.854+00', \
             'infinity', '-infinity', NULL";
        let sql = format!(
            "SELECT t, CASE WHEN t IS NULL THEN NULL \
                 ELSE least(greatest(extract(epoch from t) * 1000, 0), {MAX_MS})::int8 END \
             FROM unnest(ARRAY[{times}]::timestamptz[]) AS t"
        );
        let rows = client.query(&sql, &[]).await.expect("the times");
        assert_eq!(rows.len(), 11);
        for (i, row) in rows.iter().enumerate() {
            let server: Option<i64> = row.get(1);
            let client = time(row, 0).expect("a time");
            assert_eq!(client.map(|t| t.0 as i64), server, "time {i} of [{times}]");
        }
    }
}
