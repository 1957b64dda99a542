//! The store's own statements, prepared once on each pooled connection and found by
//! the connection's pool id and the statement's place in [`Sql`].
//!
//! deadpool's statement cache (`prepare_cached`) finds a statement by its text, and
//! hashes all of it to do so on every call: about 3,000 client instructions for the
//! claim's, a tenth of a hit's. A statement of [`Sql`] is found here by two small
//! numbers instead. Statements built per call (a listing's) still go to deadpool's
//! cache, which prepares these too on a first use.
//!
//! Connections the pool closed leave their entries behind; past a bound, the map is
//! cleared and the statements of live connections are found again in deadpool's cache
//! on their next use (no round trip).

use std::collections::HashMap;
use std::sync::RwLock;

use deadpool_postgres::{Object, ObjectId};
use tokio_postgres::Statement;

use super::sql::Sql;
use crate::sync::{read, write};

/// Entries kept before the map is cleared: far above a pool's connections times the
/// statements of [`Sql`], so a steady pool never reaches it.
const MAX_ENTRIES: usize = 4096;

/// Statements of [`Sql`] by connection and place.
#[derive(Default)]
pub(super) struct Prepared {
    statements: RwLock<HashMap<(ObjectId, usize), Statement>>,
}

impl Prepared {
    /// `sql`, one of `all`'s statements, prepared on `client`; a statement that is not
    /// one of `all`'s is prepared through deadpool's cache.
    pub(super) async fn get(
        &self,
        all: &Sql,
        client: &Object,
        sql: &str,
    ) -> Result<Statement, tokio_postgres::Error> {
        let Some(place) = all.place_of(sql) else {
            return client.prepare_cached(sql).await;
        };
        let key = (Object::id(client), place);
        if let Some(statement) = read(&self.statements).get(&key) {
            return Ok(statement.clone());
        }
        let statement = Box::pin(client.prepare_cached(sql)).await?;
        let mut statements = write(&self.statements);
        if statements.len() >= MAX_ENTRIES {
            statements.clear();
        }
        statements.insert(key, statement.clone());
        Ok(statement)
    }

    /// Forgets every statement prepared on `client`, here and in deadpool's cache: the
    /// session lost them (`DISCARD ALL`, `DEALLOCATE`), and the next use prepares them
    /// again.
    pub(super) fn forget(&self, client: &Object) {
        let id = Object::id(client);
        write(&self.statements).retain(|(on, _), _| *on != id);
        client.statement_cache.clear();
    }
}
