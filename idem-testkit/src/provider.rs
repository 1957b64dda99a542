//! A local payment provider that honours `Idempotency-Key` the way Stripe documents it:
//! the same key with the same parameters returns the stored response (marked
//! `Idempotent-Replayed: true`); the same key with other parameters is a 400 error; a
//! request without a key charges every time. It counts real charges, and answers a
//! lookup of the charge made under a key (`GET /v1/charges?idempotency_key=K`).
//!
//! [`Provider::start_without_replay`] starts one that only records keys, for lookups,
//! and charges every request: a provider whose idempotency window has passed, or that
//! keeps a client reference it never deduplicates by. There, only the client can keep a
//! retry from charging twice.
//!
//! Runs on 127.0.0.1 with an ephemeral port, for tests and examples; [`charge`] is the
//! client call a payment tool makes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

/// What a client asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChargeRequest {
    /// Who pays.
    pub customer: String,
    /// How much, in cents.
    pub amount_cents: u64,
    /// In which currency (`"eur"`).
    pub currency: String,
}

/// What the provider answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Charge {
    /// The provider's id of the charge (`ch_…`).
    pub id: String,
    /// How much was charged, in cents.
    pub amount_cents: u64,
}

#[derive(Default)]
struct Ledger {
    charges: Vec<Charge>,
    by_key: HashMap<String, (ChargeRequest, Charge)>,
    /// Whether a request with a known key replays the stored charge.
    replays: bool,
}

/// A running provider; stops with the runtime it was started on.
#[derive(Clone)]
pub struct Provider {
    addr: SocketAddr,
    ledger: Arc<Mutex<Ledger>>,
}

impl Provider {
    /// Starts the provider on the current tokio runtime.
    pub async fn start() -> std::io::Result<Provider> {
        Self::start_with(true).await
    }

    /// Starts a provider that records keys for lookups but charges every request.
    pub async fn start_without_replay() -> std::io::Result<Provider> {
        Self::start_with(false).await
    }

    async fn start_with(replays: bool) -> std::io::Result<Provider> {
        let ledger = Arc::new(Mutex::new(Ledger {
            replays,
            ..Ledger::default()
        }));
        let app = Router::new()
            .route("/v1/charges", post(handle_charge).get(handle_lookup))
            .with_state(ledger.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Provider { addr, ledger })
    }

    /// The base URL, e.g. `http://127.0.0.1:40123`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every charge really made, in order.
    pub fn charges(&self) -> Vec<Charge> {
        self.ledger.lock().unwrap().charges.clone()
    }

    /// The charge stored under an idempotency key, if any.
    pub fn charge_for_key(&self, key: &str) -> Option<Charge> {
        self.ledger
            .lock()
            .unwrap()
            .by_key
            .get(key)
            .map(|(_, c)| c.clone())
    }
}

/// What a payment tool sends: one charge request carrying `idempotency_key`. Returns
/// the charge and whether the provider replayed it (`Idempotent-Replayed`), or the
/// provider's or the transport's error as text.
pub async fn charge(
    http: &reqwest::Client,
    base: &str,
    idempotency_key: &str,
    request: &ChargeRequest,
) -> Result<(Charge, bool), String> {
    let response = http
        .post(format!("{base}/v1/charges"))
        .header("Idempotency-Key", idempotency_key)
        .json(request)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let replayed = response.headers().contains_key("Idempotent-Replayed");
    if !response.status().is_success() {
        return Err(response.text().await.unwrap_or_default());
    }
    let charge = response.json().await.map_err(|e| e.to_string())?;
    Ok((charge, replayed))
}

/// What a payment tool's reconcile hook asks: the charge made under `idempotency_key`
/// (the first, if several were), `None` if there is none, or the transport's error.
pub async fn lookup(
    http: &reqwest::Client,
    base: &str,
    idempotency_key: &str,
) -> Result<Option<Charge>, String> {
    let response = http
        // idem's keys are letters, digits, `_`, `-` and `.`: nothing to escape.
        .get(format!(
            "{base}/v1/charges?idempotency_key={idempotency_key}"
        ))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    match response.status() {
        StatusCode::NOT_FOUND => Ok(None),
        status if status.is_success() => response.json().await.map(Some).map_err(|e| e.to_string()),
        status => Err(format!("lookup answered {status}")),
    }
}

async fn handle_lookup(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    axum::extract::Query(query): axum::extract::Query<HashMap<String, String>>,
) -> Response {
    let ledger = ledger.lock().unwrap();
    let found = query
        .get("idempotency_key")
        .and_then(|key| ledger.by_key.get(key));
    match found {
        Some((_, charge)) => Json(charge.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn handle_charge(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    headers: HeaderMap,
    Json(request): Json<ChargeRequest>,
) -> Response {
    let key = headers
        .get("Idempotency-Key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut ledger = ledger.lock().unwrap();
    if let Some(key) = key.as_ref().filter(|_| ledger.replays) {
        if let Some((params, charge)) = ledger.by_key.get(key) {
            if params != &request {
                let body = "Keys for idempotent requests can only be used with the same parameters";
                return (StatusCode::BAD_REQUEST, body).into_response();
            }
            let mut response = Json(charge.clone()).into_response();
            response
                .headers_mut()
                .insert("Idempotent-Replayed", "true".parse().unwrap());
            return response;
        }
    }
    let charge = Charge {
        id: format!("ch_{:04}", ledger.charges.len() + 1),
        amount_cents: request.amount_cents,
    };
    ledger.charges.push(charge.clone());
    if let Some(key) = key {
        ledger
            .by_key
            .entry(key)
            .or_insert((request, charge.clone()));
    }
    Json(charge).into_response()
}
