#!/usr/bin/env bash
# N vlmserve replicas behind vllm-router, on one machine (for several machines, start each replica
# with `vlmserve serve --host 0.0.0.0 ...` there and list their URLs in WORKERS instead).
#
#   N=2 MODEL=mlx-community/gemma-3-4b-it-4bit ./examples/scale-out/run.sh
#   curl http://127.0.0.1:8000/v1/models
#
# Needs `pip install vllm-router`. Ctrl-C stops the gateway and every replica.
set -euo pipefail
N="${N:-2}"
PORT="${PORT:-8000}"
MODEL_ARGS=()
[ -n "${MODEL:-}" ] && MODEL_ARGS=(--model "$MODEL")
POLICY="${POLICY:-power_of_two}"  # measured against round_robin in benchmarks/README.md

pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
workers=()
for i in $(seq 1 "$N"); do
    port=$((PORT + i))
    vlmserve serve "${MODEL_ARGS[@]}" --port "$port" &
    pids+=($!)
    workers+=("http://127.0.0.1:$port")
done
for url in "${workers[@]}"; do  # the gateway only routes to replicas that answer /ready
    until curl -sf "$url/ready" >/dev/null; do sleep 1; done
done
vllm-router --worker-urls "${WORKERS:-${workers[@]}}" --policy "$POLICY" --host 127.0.0.1 --port "$PORT" \
    --health-check-endpoint /ready --health-check-interval-secs 5 &
pids+=($!)
wait
