"""AWS Lambda Powertools (Python) idempotency on Redis: hit and miss latency, for the
README's comparison with idem's Redis store on the same server.

    python3 -m venv .venv && .venv/bin/pip install "aws-lambda-powertools[redis]" boto3
    IDEM_REDIS_URL=redis://127.0.0.1:6379 .venv/bin/python benches/powertools_redis.py

The input is the same 513-byte email the Rust benches use; the result the same 114-byte
message id. Prints medians, and one GET round trip from the same client for scale.
Hits are measured twice: with Powertools' defaults, and with its local cache
(`use_local_cache=True`), the counterpart of idem's `LocalCache`.
"""

import json
import os
import statistics
import time
import uuid
import warnings

import redis
from aws_lambda_powertools.utilities.idempotency import (
    IdempotencyConfig,
    idempotent_function,
)
from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
    CachePersistenceLayer,
)

# Outside Lambda there is no context to register; Powertools warns on every call.
warnings.filterwarnings("ignore", category=UserWarning)
# Powertools warns about its own deprecated class name while building this layer.
warnings.filterwarnings("ignore", category=DeprecationWarning)

URL = os.environ.get("IDEM_REDIS_URL", "redis://127.0.0.1:6379")
BODY = 338


def email(n):
    return {
        "to": "ada.lovelace@example.com",
        "cc": ["charles.babbage@example.com"],
        "subject": "Your order #4711 has shipped today",
        "body": ("Hello Ada, your order is on its way. " * 20)[:BODY],
        "tags": {"campaign": "winter-sale", "n": f"{n:07}"},
    }


def median_us(n, op):
    samples = []
    for i in range(n):
        start = time.perf_counter_ns()
        op(i)
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


persistence = CachePersistenceLayer(url=URL)
config = IdempotencyConfig(expires_after_seconds=3600)
run = uuid.uuid4().hex


def send(message):
    return {
        "id": "msg_01HZX3V6Q8R1N4KJ7T2W9Y5B0C",
        "provider": "mailer-eu-1",
        "accepted_at": 1764681600000,
        "queue": "transaction",
    }


send_email = idempotent_function(
    data_keyword_argument="message",
    persistence_store=persistence,
    config=config,
    key_prefix=f"powertools-bench-{run}",
)(send)

send_email_cached = idempotent_function(
    data_keyword_argument="message",
    persistence_store=CachePersistenceLayer(url=URL),
    config=IdempotencyConfig(expires_after_seconds=3600, use_local_cache=True),
    key_prefix=f"powertools-bench-cached-{run}",
)(send)


client = redis.Redis.from_url(URL)
client.set(f"powertools-bench-{run}-probe", b"x" * 114)
message = email(0)
print(f"input: {len(json.dumps(message, separators=(',', ':')))} bytes of JSON")

send_email(message=message)
send_email_cached(message=message)
rt = median_us(2000, lambda _: client.get(f"powertools-bench-{run}-probe"))
hit = median_us(2000, lambda _: send_email(message=message))
cached = median_us(2000, lambda _: send_email_cached(message=message))
miss = median_us(500, lambda i: send_email(message=email(1_000_000 + i)))

print(f"one GET round trip (redis-py):  {rt:8.1f} us")
print(f"powertools hit:                  {hit:8.1f} us  ({hit / rt:.2f}x a round trip)")
print(f"powertools hit, local cache:     {cached:8.1f} us  ({cached / rt:.2f}x a round trip)")
print(f"powertools miss:                 {miss:8.1f} us  ({miss / rt:.2f}x a round trip)")
