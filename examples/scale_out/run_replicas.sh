#!/usr/bin/env bash
# N `vllm serve` replicas of one model behind vllm-router, on this machine (docs/scale_out.md).
#
#   examples/scale_out/run_replicas.sh MODEL_PATH [N] [-- extra vllm serve flags]
#
# Replicas listen on 127.0.0.1:$((PORT+1)) .. $((PORT+N)), the router on 0.0.0.0:$PORT.
# Environment (defaults in brackets):
#   PORT [8000]               router port; replicas take the ports after it
#   POLICY [cache_aware]      vllm-router policy (cache_aware, round_robin, power_of_two, ...)
#   CACHE_THRESHOLD [0.05]    cache_aware's --cache-threshold: the share of an intrinsic's message
#                             text the router must have seen on a replica to send it there (see
#                             docs/scale_out.md: 0.3, the router's default, loses long answers)
#   THREADS_PER_REPLICA [ ]   --cpu-threads for each replica (CPU: give each its own cores)
#   PIN_CORES [ ]             one `taskset -c` core list per replica, space-separated, e.g. "0 1" or
#                             "0-3 4-7": replica i runs on the i-th list (needs taskset; Linux)
#   LOG_DIR [./scale_out_logs] one log per replica and one for the router
# Ctrl-C (or SIGTERM) stops the router and every replica.
#
# Example, two replicas of a model with an aLoRA preloaded on each:
#   examples/scale_out/run_replicas.sh ibm-granite/granite-3.3-8b-instruct 2 -- \
#       --enable-lora --enable-activated-lora --max-lora-rank 64 \
#       --lora-modules certainty=/adapters/certainty_alora
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    sed -n '2,22p' "$0" >&2
    exit 2
fi
MODEL="$1"; shift
N=2
if [[ $# -gt 0 && "$1" != "--" ]]; then N="$1"; shift; fi
if [[ $# -gt 0 && "$1" == "--" ]]; then shift; fi
if ! [[ "$N" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_replicas.sh: N must be a positive integer, got '$N'" >&2
    exit 2
fi
if ! command -v vllm-router >/dev/null; then
    echo "run_replicas.sh: vllm-router is not installed (pip install vllm-router==0.1.17)" >&2
    exit 2
fi

PIN=()
if [[ -n "${PIN_CORES:-}" ]]; then
    read -r -a PIN <<<"$PIN_CORES"
    if [[ ${#PIN[@]} -ne $N ]]; then
        echo "run_replicas.sh: PIN_CORES needs one core list per replica ($N), got '${PIN_CORES}'" >&2
        exit 2
    fi
    if ! command -v taskset >/dev/null; then
        echo "run_replicas.sh: PIN_CORES needs taskset (util-linux), which is not installed" >&2
        exit 2
    fi
fi

PORT="${PORT:-8000}"
POLICY="${POLICY:-cache_aware}"
CACHE_THRESHOLD="${CACHE_THRESHOLD:-0.05}"
LOG_DIR="${LOG_DIR:-./scale_out_logs}"
mkdir -p "$LOG_DIR"

PIDS=()
stop_all() {
    trap - INT TERM EXIT
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap stop_all INT TERM EXIT

URLS=()
for i in $(seq 1 "$N"); do
    port=$((PORT + i))
    threads=()
    if [[ -n "${THREADS_PER_REPLICA:-}" ]]; then threads=(--cpu-threads "$THREADS_PER_REPLICA"); fi
    pin=()
    if [[ ${#PIN[@]} -gt 0 ]]; then pin=(taskset -c "${PIN[$((i - 1))]}"); fi
    "${pin[@]}" vllm serve "$MODEL" --host 127.0.0.1 --port "$port" "${threads[@]}" "$@" >"$LOG_DIR/replica_$i.log" 2>&1 &
    PIDS+=($!)
    URLS+=("http://127.0.0.1:$port")
    echo "replica $i: ${URLS[-1]} (log: $LOG_DIR/replica_$i.log)"
done

# wait_up URL PID LOG NAME: until URL answers; if PID exits first, show the end of LOG and fail.
wait_up() {
    until curl -sf "$1" >/dev/null; do
        if ! kill -0 "$2" 2>/dev/null; then
            echo "$4 exited; the end of its log:" >&2
            tail -n 20 "$3" >&2
            exit 1
        fi
        sleep 1
    done
}

# The router waits for every replica's /health itself; waiting here first reports a replica
# that fails to start with its own log instead of a router timeout.
for i in $(seq 1 "$N"); do
    wait_up "${URLS[$((i - 1))]}/health" "${PIDS[$((i - 1))]}" "$LOG_DIR/replica_$i.log" "replica $i"
done

policy_args=(--policy "$POLICY")
if [[ "$POLICY" == "cache_aware" ]]; then policy_args+=(--cache-threshold "$CACHE_THRESHOLD"); fi
vllm-router --host 0.0.0.0 --port "$PORT" --worker-urls "${URLS[@]}" "${policy_args[@]}" \
    --worker-startup-check-interval 1 --health-check-interval-secs 5 \
    --prometheus-host 127.0.0.1 --prometheus-port $((PORT + N + 1)) >"$LOG_DIR/router.log" 2>&1 &
PIDS+=($!)
wait_up "http://127.0.0.1:$PORT/readiness" "${PIDS[-1]}" "$LOG_DIR/router.log" "the router"
echo "router ($POLICY): http://127.0.0.1:$PORT  (metrics: http://127.0.0.1:$((PORT + N + 1))/metrics)"
echo "Ctrl-C stops everything."
wait -n "${PIDS[@]}"
echo "a process exited; stopping the rest" >&2
