//! The workload both the `bench` example and the criterion benches measure: a
//! 513-byte email in, a 114-byte message id out, and the hand-written floor of key
//! derivation to compare against.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::Write;

use idem::{idempotent, Error, Run};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SendEmail {
    pub to: String,
    pub cc: Vec<String>,
    pub subject: String,
    pub body: String,
    pub tags: HashMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MessageId {
    pub id: String,
    pub provider: String,
    pub accepted_at: u64,
    pub queue: String,
}

/// The usual body length: the email is then 513 bytes of JSON.
pub const BODY: usize = 338;

/// Email number `n`, with a body of `body_len` characters.
pub fn email(n: u64, body_len: usize) -> SendEmail {
    let mut tags = HashMap::new();
    tags.insert("campaign".to_string(), "winter-sale".to_string());
    tags.insert("n".to_string(), format!("{n:07}"));
    SendEmail {
        to: "ada.lovelace@example.com".into(),
        cc: vec!["charles.babbage@example.com".into()],
        subject: "Your order #4711 has shipped today".into(),
        body: "Hello Ada, your order is on its way. "
            .chars()
            .cycle()
            .take(body_len)
            .collect(),
        tags,
    }
}

pub fn message_id() -> MessageId {
    MessageId {
        id: "msg_01HZX3V6Q8R1N4KJ7T2W9Y5B0C".into(),
        provider: "mailer-eu-1".into(),
        accepted_at: 1_764_681_600_000,
        queue: "transaction".into(),
    }
}

/// The tool body: cheap, so measurements show idem's own cost.
pub fn send(_input: &SendEmail) -> MessageId {
    message_id()
}

/// The tool, made idempotent.
#[idempotent(name = "send_email")]
pub async fn send_email(run: &Run, input: &SendEmail) -> Result<MessageId, Error> {
    Ok(send(input))
}

struct HashWriter(Sha256);

impl Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The floor of key derivation: JSON streamed into SHA-256 (no key sorting), hex into
/// a stack buffer.
pub fn floor_key(input: &SendEmail) -> [u8; 64] {
    let mut h = HashWriter(Sha256::new());
    serde_json::to_writer(&mut h, input).unwrap();
    let digest = h.0.finalize();
    let mut hex = [0u8; 64];
    for (i, b) in digest.iter().enumerate() {
        hex[2 * i] = b"0123456789abcdef"[usize::from(b >> 4)];
        hex[2 * i + 1] = b"0123456789abcdef"[usize::from(b & 15)];
    }
    hex
}
