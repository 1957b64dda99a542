#!/usr/bin/env bash
# What idem's Postgres statements cost the server: the backend's CPU per transaction
# (read from /proc, so the server must run on this machine), for a hit and a miss of
# the claim statement, and of the same claim as a PL/pgSQL function (tried, not kept:
# docs/performance.md), next to a plain SELECT of the same row (and the same SELECT with
# its times converted to milliseconds by the server, as the statements did before they
# sent times as stored); and a miss (claim,
# then completion) on idem's table with its indexes (the listings' of settled rows),
# with listing indexes of every row (as before) and without any, next to the
# throughput floor's. Three more misses price what separates idem's from the floor's
# (tried, not kept: docs/performance.md): on a table whose completion changes no
# indexed column, so that it is a heap-only update (`miss_heap_only`); the same with a
# plain `INSERT` for the claim (`miss_heap_only_plain_insert`); and the same with no
# `result jsonb` written (`miss_heap_only_no_jsonb`).
#
#   IDEM_POSTGRES_URL=postgres://root@127.0.0.1/test benches/postgres_server.sh [ROUNDS [SCRIPT...]]
#
# (SCRIPT: any of the names the table prints, to run only those.)
#
# Each round runs every statement once, 20,000 prepared transactions from one pgbench
# session, in turn; the medians over the rounds are printed. The statements copy those
# of idem-core/src/store/postgres/sql.rs: keep them alike when those change. Everything
# lives in the schema idem_server_bench, dropped at the end.
set -euo pipefail

url=${IDEM_POSTGRES_URL:?set IDEM_POSTGRES_URL}
rounds=${1:-6}
shift || true
work=$(mktemp -d)
trap 'psql -q "$url" -c "DROP SCHEMA IF EXISTS idem_server_bench CASCADE" >/dev/null 2>&1; rm -rf "$work"' EXIT

# (The server's conversion, which the statements no longer make.)
ms() { echo "(CASE WHEN $1 IS NULL THEN NULL ELSE least(greatest(extract(epoch from $1) * 1000, 0), 9000000000000000)::int8 END)"; }
columns="r.fingerprint, r.state, r.token, r.lease_until, r.payload, r.expires_at"
converted="r.fingerprint, r.state, r.token, $(ms r.lease_until), r.payload, $(ms r.expires_at)"
insert_columns="key, fingerprint, state, token, lease_until, payload, created_at, expires_at, run_id, tenant, call_id, tool, claimed_at, attempts, takeovers"
values="now() + \$4::int8 * interval '1 millisecond', NULL, now(), now() + \$5::int8 * interval '1 millisecond'"

table() { # name, listing indexes: settled (idem's), every (of every row, as before), none,
    # heap_only (of every row, and no index on a column a completion changes)
    local t=idem_server_bench.$1
    echo "CREATE TABLE $t (key text PRIMARY KEY, fingerprint bytea NOT NULL, state smallint NOT NULL,
        token bytea NOT NULL, lease_until timestamptz, payload bytea, created_at timestamptz NOT NULL,
        expires_at timestamptz NOT NULL, run_id text, tenant text, call_id text, tool text,
        claimed_at timestamptz, completed_at timestamptz, renewed_at timestamptz,
        attempts integer NOT NULL DEFAULT 0, takeovers integer NOT NULL DEFAULT 0, result jsonb);
    CREATE INDEX ON $t (expires_at);"
    case $2 in
        heap_only) ;;
        *) echo "CREATE INDEX ON $t (lease_until) WHERE state = 0;
            CREATE INDEX ON $t (key) WHERE result IS NULL AND state <> 0;" ;;
    esac
    case $2 in
        settled) echo "CREATE INDEX ON $t (run_id, key) WHERE state <> 0; CREATE INDEX ON $t (tool, key) WHERE state <> 0;" ;;
        every | heap_only) echo "CREATE INDEX ON $t (run_id, key); CREATE INDEX ON $t (tool, key);" ;;
    esac
    echo "INSERT INTO $t SELECT 'hit.' || g, sha256(g::text::bytea), 1, '\\x00112233445566778899aabbccddeeff',
        NULL, convert_to(repeat('x', 114), 'UTF8'), now(), now() + interval '1 day', 'run-1', NULL, NULL,
        'send_email', now(), now(), NULL, 1, 0, '{\"id\": 1}' FROM generate_series(1, 10000) AS g;
    VACUUM ANALYZE $t;"
}

{
    echo "SET client_min_messages = warning;"
    echo "DROP SCHEMA IF EXISTS idem_server_bench CASCADE; CREATE SCHEMA idem_server_bench;"
    table records settled
    table listed_every_row every
    table unlisted none
    table heap_only heap_only
    echo "CREATE TABLE idem_server_bench.floor (k text PRIMARY KEY, v bytea);"
    echo "CREATE FUNCTION idem_server_bench.claim(text, bytea, bytea, int8, int8, text, text, text, text,
        OUT o_fingerprint bytea, OUT o_state smallint, OUT o_token bytea, OUT o_lease timestamptz,
        OUT o_payload bytea, OUT o_expires timestamptz, OUT o_now timestamptz, OUT o_inserted int8)
    LANGUAGE plpgsql AS \$idem\$ BEGIN
        SELECT $columns INTO o_fingerprint, o_state, o_token, o_lease, o_payload, o_expires
            FROM idem_server_bench.records AS r WHERE r.key = \$1;
        o_inserted := 0;
        IF NOT FOUND THEN
            INSERT INTO idem_server_bench.records AS r ($insert_columns)
            VALUES (\$1, \$2, 0, \$3, $values, \$6, \$7, \$8, \$9, now(), 1, 0) ON CONFLICT (key) DO NOTHING;
            IF FOUND THEN o_inserted := 1; END IF;
        END IF;
        o_now := now();
    END \$idem\$;"
} | psql -q -v ON_ERROR_STOP=1 "$url" >/dev/null

# A claim's arguments for key expression $1 (pgbench's :k substituted in).
args="'\\x00'::bytea, '\\x01'::bytea, 30000::int8, 86400000::int8, 'run-1'::text, NULL::text, NULL::text, 'send_email'::text"
hit='\set k random(1, 10000)'
miss='\set k random(1, 1000000000000)'
cte() { # key expression
    echo "WITH found AS (SELECT $columns FROM idem_server_bench.records AS r WHERE r.key = $1),
        fresh AS (INSERT INTO idem_server_bench.records AS r ($insert_columns)
            SELECT ($1)::text, '\\x00'::bytea, 0, '\\x01'::bytea, now() + interval '30 s', NULL, now(),
                now() + interval '1 day', 'run-1'::text, NULL::text, NULL::text, 'send_email'::text, now(), 1, 0
            WHERE NOT EXISTS (SELECT 1 FROM found) ON CONFLICT (key) DO NOTHING RETURNING 1)
        SELECT found.*, now(), (SELECT count(*) FROM fresh) FROM (SELECT 1) AS one LEFT JOIN found ON true;"
}
completed_miss() { # table
    local t=idem_server_bench.$1 key="'miss.' || :k"
    echo "$miss
    INSERT INTO $t AS r ($insert_columns) VALUES ($key, '\\x00', 0, '\\x01', now() + interval '30 s', NULL, now(),
        now() + interval '1 day', 'run-' || (:k::int8 % 100), NULL, NULL, 'send_email', now(), 1, 0) ON CONFLICT (key) DO NOTHING;
    UPDATE $t SET state = 1, payload = convert_to(repeat('x', 114), 'UTF8'), result = '{\"id\": 1}'::text::jsonb,
        lease_until = NULL, created_at = now(), completed_at = now(), expires_at = now() + interval '1 day'
        WHERE key = $key AND CASE WHEN state = 0 AND expires_at > now() THEN true ELSE false END;"
}
printf '%s\nSELECT %s, now() FROM idem_server_bench.records AS r WHERE r.key = %s;\n' "$hit" "$columns" "'hit.' || :k" >"$work/select.sql"
printf '%s\nSELECT %s, %s FROM idem_server_bench.records AS r WHERE r.key = %s;\n' "$hit" "$converted" "$(ms "now()")" "'hit.' || :k" >"$work/select_converted.sql"
printf '%s\n%s\n' "$hit" "$(cte "'hit.' || :k")" >"$work/hit_statement.sql"
printf '%s\nSELECT * FROM idem_server_bench.claim(%s, %s);\n' "$hit" "'hit.' || :k" "$args" >"$work/hit_function.sql"
printf '%s\n%s\n' "$miss" "$(cte "'claim.' || :k")" >"$work/miss_statement.sql"
printf '%s\nSELECT * FROM idem_server_bench.claim(%s, %s);\n' "$miss" "'claim.' || :k" "$args" >"$work/miss_function.sql"
completed_miss records >"$work/miss_all_indexes.sql"
completed_miss listed_every_row >"$work/miss_every_row_listed.sql"
completed_miss unlisted >"$work/miss_no_listing_indexes.sql"
# The completion leaves the expiry as the claim wrote it, so it changes no indexed column.
heap_only() { completed_miss heap_only | sed "s/, expires_at = now() + interval '1 day'//$1"; }
heap_only "" >"$work/miss_heap_only.sql"
heap_only "; s/ ON CONFLICT (key) DO NOTHING//" >"$work/miss_heap_only_plain_insert.sql"
heap_only "; s/, result = [^,]*jsonb//" >"$work/miss_heap_only_no_jsonb.sql"
printf '%s\nINSERT INTO idem_server_bench.floor VALUES (%s, convert_to(repeat(%s, 78), %s));\nUPDATE idem_server_bench.floor SET v = convert_to(repeat(%s, 114), %s) WHERE k = %s;\n' \
    "$miss" "'miss.' || :k" "'x'" "'UTF8'" "'x'" "'UTF8'" "'miss.' || :k" >"$work/miss_floor.sql"

# The backend CPU (µs) per transaction of one pgbench session running script $1.
cpu() {
    local n=20000 name="idem_server_bench_$RANDOM$RANDOM"
    PGAPPNAME=$name pgbench -n -M prepared -c 1 -t "$n" -f "$1" "$url" >"$work/out" 2>&1 &
    local bench=$! pid="" last=0 s
    while [ -z "$pid" ] && kill -0 "$bench" 2>/dev/null; do
        pid=$(psql -Atq "$url" -c "SELECT pid FROM pg_stat_activity WHERE application_name = '$name'" | head -1)
    done
    # A backend still at work that /proc does not show runs on another machine (one
    # that ended meanwhile is simply gone).
    if [ -n "$pid" ] && [ ! -r "/proc/$pid/stat" ] &&
        [ -n "$(psql -Atq "$url" -c "SELECT 1 FROM pg_stat_activity WHERE pid = $pid")" ]; then
        echo "the server's backend $pid is not a process of this machine" >&2
        exit 1
    fi
    while kill -0 "$bench" 2>/dev/null; do
        s=$(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null) && [ -n "$s" ] && last=$s
        sleep 0.05
    done
    wait "$bench" || { cat "$work/out" >&2; exit 1; }
    # A session that ended before its backend was found: run it again.
    if [ "$last" = 0 ] && [ "${2:-}" != again ]; then cpu "$1" again; return; fi
    echo $((last * 1000000 / $(getconf CLK_TCK) / n))
}

scripts=(select select_converted hit_statement hit_function miss_statement miss_function miss_floor miss_all_indexes miss_every_row_listed miss_no_listing_indexes
    miss_heap_only miss_heap_only_plain_insert miss_heap_only_no_jsonb)
if [ $# -gt 0 ]; then scripts=("$@"); fi
for _ in $(seq "$rounds"); do
    for s in "${scripts[@]}"; do echo "$s $(cpu "$work/$s.sql")"; done
done >"$work/all"
echo "backend CPU per transaction, µs: median (all $rounds rounds)"
for s in "${scripts[@]}"; do
    values=$(awk -v s="$s" '$1 == s {print $2}' "$work/all" | sort -n | tr '\n' ' ')
    median=$(echo "$values" | tr ' ' '\n' | grep . | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}')
    printf '%-28s %6s   (%s)\n' "$s" "$median" "${values% }"
done
# Whether each table's completions were heap-only updates (no index entries), as counted
# by the server (its statistics can lag by a second; idle tables are left out).
echo "updates, of them heap-only (per table):"
psql -Atq "$url" -c "SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
    WHERE schemaname = 'idem_server_bench' AND n_tup_upd > 0 ORDER BY relname" | tr '|' ' ' | sed 's/^/  /'
