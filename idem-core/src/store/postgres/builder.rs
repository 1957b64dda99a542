//! [`PostgresStoreBuilder`]: the URL, table, timeout and pool size of a store.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::Semaphore;
use tokio_postgres::NoTls;

use super::sql::Sql;
use super::{Inner, PostgresStore, STORE};
use crate::error::{Error, StoreErrorKind};

/// Configures a [`PostgresStore`]: table name, timeout, pool size.
#[derive(Debug, Clone)]
pub struct PostgresStoreBuilder {
    url: String,
    table: String,
    timeout: Duration,
    max_connections: usize,
}

impl PostgresStoreBuilder {
    /// The defaults: table `idem_records`, a 5-second timeout, 16 connections.
    pub(super) fn new(url: &str) -> Self {
        PostgresStoreBuilder {
            url: url.to_owned(),
            table: "idem_records".to_owned(),
            timeout: Duration::from_secs(5),
            max_connections: 16,
        }
    }

    /// The table that holds the records (`idem_records` by default). A plain or
    /// schema-qualified identifier: letters, digits and `_`, not starting with a digit.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The bound on every operation, connecting included (5 seconds by default):
    /// between 1 millisecond and `i32::MAX` milliseconds (about 24.8 days), as Postgres
    /// takes its `lock_timeout` in whole milliseconds up to that; outside, building the
    /// store fails with a [`StoreErrorKind::Config`] error.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The most connections the store's pool opens (16 by default). Running calls'
    /// renewals hold one of them at most, sent together as one statement, and take the
    /// next connection free ahead of the other calls waiting.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Builds the store without connecting: connections open on first use. Does not
    /// create the table; call [`PostgresStore::migrate`].
    pub fn build(self) -> Result<PostgresStore, Error> {
        crate::store::check_timeout(
            STORE,
            self.timeout,
            Duration::from_millis(1),
            crate::store::MILLIS_I32,
        )?;
        let table = quote_table(&self.table)?;
        let mut config: tokio_postgres::Config = self.url.parse().map_err(|e| {
            Error::store_of_kind(
                STORE,
                StoreErrorKind::Config,
                format!("invalid connection URL: {e}"),
            )
        })?;
        config.connect_timeout(self.timeout);
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(30));
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(self.max_connections)
            .wait_timeout(Some(self.timeout))
            .create_timeout(Some(self.timeout))
            .recycle_timeout(Some(self.timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| Error::store(STORE, e))?;
        Ok(PostgresStore {
            inner: Arc::new(Inner {
                pool,
                calls: Semaphore::new(self.max_connections),
                renewals: Default::default(),
                sql: Sql::new(&table),
                table,
                timeout: self.timeout,
                prepared: Default::default(),
                streak: Default::default(),
            }),
        })
    }

    /// Builds the store, connects, and creates the table if it is missing (or adds the
    /// columns a table of idem 0.1 lacks), within the store's timeout, whatever other
    /// sessions do. The operators' indexes are then built in the background by one
    /// worker (see [`PostgresStore::migrate`]): calls do not need them.
    pub async fn connect(self) -> Result<PostgresStore, Error> {
        let store = self.build()?;
        store.create_table(store.inner.timeout).await?;
        let building = store.clone();
        tokio::spawn(async move {
            if let Err(error) = building.build_indexes(false).await {
                tracing::warn!(table = %building.inner.table, %error, "idem: building the operators' indexes failed; `PostgresStore::migrate()` builds them (listings are slower meanwhile, calls are not)");
            }
        });
        Ok(store)
    }
}

/// `"schema"."table"`, or an error for anything but plain identifiers.
fn quote_table(name: &str) -> Result<String, Error> {
    let parts: Vec<&str> = name.split('.').collect();
    let valid = |p: &&str| {
        !p.is_empty()
            && p.len() <= 63
            && !p.starts_with(|c: char| c.is_ascii_digit())
            && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    if parts.len() > 2 || !parts.iter().all(valid) {
        return Err(Error::store_of_kind(
            STORE,
            StoreErrorKind::Config,
            format!("invalid table name `{name}`: use letters, digits and `_` (optionally `schema.table`)"),
        ));
    }
    Ok(parts
        .iter()
        .map(|p| format!("\"{p}\""))
        .collect::<Vec<_>>()
        .join("."))
}
