#!/usr/bin/env bash
# A real Prometheus server scrapes a running stageb: rank 0 (`stageb coordinator`) and one
# worker (`stageb worker`, real model), each with --metrics-listen. Checks, through Prometheus'
# own HTTP API, that both targets are `up` and that stageb_tickets_decided_total rises while
# the run goes on; `promtool check metrics` lints a scrape of each endpoint; the run itself must
# end with exit 0.
#
#   scripts/ci/test-prometheus.sh            (from anywhere; uses target/debug/stageb or STAGEB_BIN)
#
# Installs Debian's `prometheus` package (which brings promtool) when missing. Exit codes:
# 0 passed; 1 a check failed; 77 skipped because Prometheus cannot be installed here (the
# reason is printed; .ci/run decides what a skip means).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo="$PWD"

say() { echo "test-prometheus: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    say "SKIPPED: prometheus is not installed and there is no apt-get to install it"
    exit 77
  fi
  sudo=""
  [[ "$(id -u)" == 0 ]] || sudo="sudo -n"
  say "installing Debian's prometheus package"
  # Another script may be installing packages at the same time: wait for dpkg's lock.
  if ! { $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq &&
         DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
           --no-install-recommends prometheus >/dev/null; }; then
    say "SKIPPED: apt-get could not install prometheus (no package index or no root)"
    exit 77
  fi
fi
# The package's service would hold port 9090 on a machine with systemd; ours uses its own port.

bin="${STAGEB_BIN:-$repo/target/debug/stageb}"
[[ -x "$bin" ]] || { say "building stageb"; cargo build --bin stageb; }
model="$(scripts/fetch-model.sh | tail -n1)"

work="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
grpc_port="$(free_port)"; rank0_metrics="$(free_port)"; worker_metrics="$(free_port)"; prom_port="$(free_port)"

# The 6-ticket demo over six epochs, written to a scratch directory: the checks below scrape
# both processes while the run goes on, so it must outlast them. (Two epochs did on the old
# one-job-at-a-time worker; a batching worker finished them before the scrapes, and a CI run
# failed with "no worker token counter".)
sed -e "s|^  root: runs|  root: $work/runs|" -e 's|^  run_name: demo-small|  run_name: prometheus-test|' \
    -e 's|^  epochs: 1|  epochs: 6|' examples/demo/small/config.yaml >"$work/config.yaml"
grep -q "root: $work/runs" "$work/config.yaml" && grep -q '^  epochs: 6$' "$work/config.yaml" ||
  fail "could not point the config at the scratch directory with six epochs"

"$bin" coordinator --config "$work/config.yaml" --listen "127.0.0.1:$grpc_port" \
  --metrics-listen "127.0.0.1:$rank0_metrics" >"$work/rank0.log" 2>&1 &
rank0=$!; pids+=("$rank0")
"$bin" worker --coordinator "127.0.0.1:$grpc_port" --model "$model" \
  --metrics-listen "127.0.0.1:$worker_metrics" >"$work/worker.log" 2>&1 &
pids+=("$!")

cat >"$work/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: stageb-rank0
    static_configs: [{targets: ["127.0.0.1:$rank0_metrics"]}]
  - job_name: stageb-worker
    static_configs: [{targets: ["127.0.0.1:$worker_metrics"]}]
EOF
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" >"$work/prometheus.log" 2>&1 &
pids+=("$!")

api() { curl -fsS --get "http://127.0.0.1:$prom_port/api/v1/$1" "${@:2}"; }
# The sum over the series of an instant query, or "none" while it has no sample.
query_value() {
  api query --data-urlencode "query=$1" 2>/dev/null | python3 -c '
import json, sys
r = json.load(sys.stdin)["data"]["result"]
print(sum(float(s["value"][1]) for s in r) if r else "none")' || echo none
}

say "waiting for both targets to be up"
for _ in $(seq 120); do
  up="$(api targets 2>/dev/null | python3 -c '
import json, sys
t = json.load(sys.stdin)["data"]["activeTargets"]
print(sum(1 for x in t if x["health"] == "up"))' 2>/dev/null || echo 0)"
  [[ "$up" == 2 ]] && break
  sleep 1
done
[[ "$up" == 2 ]] || { cat "$work/prometheus.log" >&2; fail "targets up: $up of 2"; }
say "both targets up"

say "waiting for stageb_tickets_decided_total to rise"
first=none; rose=0
for _ in $(seq 240); do
  v="$(query_value stageb_tickets_decided_total)"
  if [[ "$v" != none ]] && python3 -c "import sys; sys.exit(0 if float('$v') > 0 else 1)"; then
    if [[ "$first" == none ]]; then
      first="$v"
    elif python3 -c "import sys; sys.exit(0 if float('$v') > float('$first') else 1)"; then
      rose=1; break
    fi
  fi
  kill -0 "$rank0" 2>/dev/null || break
  sleep 1
done
((rose)) || fail "stageb_tickets_decided_total did not rise (first $first, last $v)"
say "stageb_tickets_decided_total rose from $first to $v"
# Any sample in the last minutes: a series goes stale at once if its target is gone.
tokens="$(query_value 'max_over_time(stageb_worker_decode_tokens_total[5m])')"
[[ "$tokens" != none ]] || fail "no worker token counter in Prometheus"
say "worker decode tokens so far: $tokens"

for port in "$rank0_metrics" "$worker_metrics"; do
  curl -fsS "http://127.0.0.1:$port/metrics" >"$work/scrape-$port.txt" ||
    fail "scraping 127.0.0.1:$port failed"
  promtool check metrics <"$work/scrape-$port.txt" || fail "promtool check metrics on port $port"
done
say "promtool check metrics: both scrapes clean"

say "waiting for the run to finish"
code=0; wait "$rank0" || code=$?
[[ "$code" == 0 ]] || { tail -n 20 "$work/rank0.log" >&2; fail "rank 0 exited $code"; }
say "passed (run complete, exit 0)"
