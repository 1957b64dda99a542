use std::time::Instant;
fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let url = "postgres://root@127.0.0.1:5432/test";
        let t = "zz_pgto";
        let store = idem::PostgresStore::builder(url).table(t).connect().await.unwrap();
        let c = store.pool().get().await.unwrap();
        let fill = format!("TRUNCATE {t}; INSERT INTO {t} SELECT 'purge_fill.' || lpad(to_hex(g), 64, '0'), decode(repeat('07', 32), 'hex'), 1, decode(repeat('01', 16), 'hex'), NULL, decode(repeat('61', 114), 'hex'), now() - interval '2 hours', now() - interval '1 hour' + g * interval '1 millisecond' FROM generate_series(1, 1000000) AS g");
        let batched = format!("WITH gone AS (DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t} WHERE expires_at <= now() AND expires_at >= to_timestamp($1::int8 / 1000.0) ORDER BY expires_at LIMIT $2)) AND expires_at <= now() RETURNING expires_at) SELECT count(*), coalesce(floor(extract(epoch from max(expires_at)) * 1000)::int8, 0) FROM gone");
        let stmt = c.prepare(&batched).await.unwrap();
        for round in 0..2 {
            for size in [0i64, 10_000, 50_000] {
                c.batch_execute(&fill).await.unwrap();
                c.batch_execute(&format!("VACUUM ANALYZE {t}")).await.unwrap();
                let start = Instant::now();
                let mut worst = std::time::Duration::ZERO;
                let mut stmts = 0;
                if size == 0 {
                    c.execute(&format!("DELETE FROM {t} WHERE expires_at <= now()"), &[]).await.unwrap();
                    stmts = 1;
                    worst = start.elapsed();
                } else {
                    let mut from = 0i64;
                    loop {
                        let s = Instant::now();
                        let row = c.query_one(&stmt, &[&from, &size]).await.unwrap();
                        worst = worst.max(s.elapsed());
                        stmts += 1;
                        let n: i64 = row.get(0);
                        from = from.max(row.get(1));
                        if n < size { break; }
                    }
                }
                println!("round {round} batch {size:>7}: {:?} total, {stmts} statements, longest {:?}", start.elapsed(), worst);
            }
        }
        c.batch_execute(&format!("DROP TABLE {t}")).await.unwrap();
    });
}
