//! A local payment provider that honours `Idempotency-Key` the way Stripe documents it:
//! the same key with the same parameters returns the stored response (marked
//! `Idempotent-Replayed: true`); the same key with other parameters is a 400 error; a
//! request without a key charges every time. It counts real charges.
//!
//! Runs on 127.0.0.1 with an ephemeral port, for tests and examples; [`charge`] is the
//! client call a payment tool makes.

#![allow(dead_code)]

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
    pub customer: String,
    pub amount_cents: u64,
    pub currency: String,
}

/// What the provider answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Charge {
    pub id: String,
    pub amount_cents: u64,
}

#[derive(Default)]
struct Ledger {
    charges: Vec<Charge>,
    by_key: HashMap<String, (ChargeRequest, Charge)>,
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
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let app = Router::new()
            .route("/v1/charges", post(handle_charge))
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
    if let Some(key) = &key {
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
        ledger.by_key.insert(key, (request, charge.clone()));
    }
    Json(charge).into_response()
}
