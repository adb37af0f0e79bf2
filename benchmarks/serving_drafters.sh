#!/bin/bash
# The server at 8 concurrent clients: the default drafter (auto: trees) against target-only (-k 0), interleaved
# usage: [ROUNDS=2] benchmarks/serving_drafters.sh   (writes $OUT/{none,auto}-ROUND.json ; the servers log to $TMPDIR)
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/serving/drafters}; mkdir -p $OUT
.venv/bin/specdecode serve --port 8801 --no-response-cache --no-draft-store > "${TMPDIR:-/tmp}/serve-auto.log" 2>&1 &
A=$!
.venv/bin/specdecode serve --port 8802 -k 0 --no-response-cache --no-draft-store > "${TMPDIR:-/tmp}/serve-none.log" 2>&1 &
N=$!
for p in 8801 8802; do for i in $(seq 120); do curl -s localhost:$p/health >/dev/null && break; sleep 1; done; done
for round in $(seq ${ROUNDS:-2}); do
  for s in none:8802 auto:8801; do
    name=${s%%:*}; port=${s##*:}
    echo "== round $round $name"
    .venv/bin/specdecode loadtest --url http://127.0.0.1:$port --concurrency 1,8 --requests 24 --max-tokens 64 --output $OUT/$name-$round.json 2>&1 | grep -v "^$" | tail -12
  done
done
curl -s localhost:8801/metrics | grep -E "^specdecode_(tree|spec|tokens_per)" | head -20
kill $A $N
