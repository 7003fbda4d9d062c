#!/usr/bin/env bash
# `make serve MPS=1` as a GPU user runs it, after `make demo` built model_repository:
#
#     bash bench/gpu/serve_mps_check.sh OUT [ROUNDS]
#
# Each round serves the demo's repository twice, with the daemon (`make serve-bg MPS=1`) and without (`MPS=0`),
# in turn (on, off; the next round off, on); a last serve with MPS unset checks the default (its ready line), and loads efficientnet_lite0_fp16 with perfclient at concurrency 32 and 256,
# inputs and outputs in CUDA shared memory. perfclient runs outside MPS (its environment names no pipe folder), as
# a client on another host or in another container would. The first MPS serve is also checked: its ready line
# (how many processes reached the daemon), `make verify` under MPS, the daemon's server list, and that `make stop`
# leaves no daemon and no socket. Written to OUT: perfclient's JSON per run, the serve output, checks.txt.
# Exit status 0 when every step held.
set -u
out=${1:?usage: serve_mps_check.sh OUT [ROUNDS]}
rounds=${2:-1}
mkdir -p "$out"
checks=$out/checks.txt
status=0
note() { echo "$*" | tee -a "$checks"; }
fail() { note "FAIL: $*"; status=1; }
# Live MPS processes: an ended daemon stays a zombie until the machine's init reaps it (it outlives the
# `serve --background` process that started it); on an H200 each was gone by the next round.
daemons() { ps -eo pid=,stat=,args= | awk '$2 !~ /^Z/ && /nvidia-cuda-mps/ && !/awk/'; }
host=$(daemons)  # a host's own daemons, there before: not ours to count

load() {  # $1: label; perfclient at 32 and 256, outside MPS
    for c in 32 256; do
        env -u CUDA_MPS_PIPE_DIRECTORY -u CUDA_MPS_LOG_DIRECTORY .venv/bin/perfclient -m efficientnet_lite0_fp16 \
            -u localhost:8001 --concurrency "$c" --shared-memory cuda --measurement-interval 2000 --max-trials 5 \
            --metrics-url http://localhost:8002/metrics --json "$out/$1-c$c.json" --no-progress -q \
            > "$out/$1-c$c.txt" 2>&1 || fail "perfclient $1 c=$c exit $? ($(tail -1 "$out/$1-c$c.txt"))"
        .venv/bin/python - "$out/$1-c$c.json" "$1" "$c" <<'EOF' | tee -a "$checks"
import json, sys
doc = json.load(open(sys.argv[1]))
rows = doc["results"] if isinstance(doc, dict) and "results" in doc else doc
r = rows[0] if isinstance(rows, list) else rows
lat = r.get("latency_us", {})
power = r.get("power") or {}
server = r.get("server") or {}
print(f"{sys.argv[2]} c={sys.argv[3]}: {r.get('throughput', 0):.0f} infer/s, p50 {lat.get('p50', 0) / 1e3:.2f} ms, "
      f"p99 {lat.get('p99', 0) / 1e3:.2f} ms, p99/p50 {lat.get('p99', 0) / max(lat.get('p50', 1), 1):.2f}, "
      f"J/inference {power.get('j_per_infer')}, batch {server.get('avg_batch')}, "
      f"compute_input {server.get('compute_input_us')} us/request")
EOF
    done
}

serve() {  # $1: label, $2: MPS value (1, 0 or empty)
    make --no-print-directory serve-bg MPS="$2" > "$out/$1-serve.txt" 2>&1 || { fail "serve $1 exit $?"; \
        tail -5 "$out/$1-serve.txt" | tee -a "$checks"; return 1; }
    note "$1 ready: $(tail -1 "$out/$1-serve.txt")"
    if [ "$2" = 0 ] && grep -q "CUDA MPS" "$out/$1-serve.txt"; then fail "serve $1 (MPS=0) mentions MPS"; fi
    if [ "$2" = 0 ] && [ "$(daemons)" != "$host" ]; then fail "serve $1 (MPS=0) has an MPS daemon: $(daemons)"; fi
}

stop() {  # $1: label
    make --no-print-directory stop > "$out/$1-stop.txt" 2>&1 || fail "stop $1 exit $?"
    left=$(daemons)
    [ "$left" = "$host" ] || fail "after stop $1 MPS processes are left: $left"
    [ ! -e .run/mps/pipe/control ] || fail "after stop $1 the control socket is left"
}

first=1
for round in $(seq 1 "$rounds"); do
    order="on off"; [ $((round % 2)) -eq 0 ] && order="off on"
    for mode in $order; do
        label=$mode-$round
        if [ "$mode" = on ]; then serve "$label" 1 || continue; else serve "$label" 0 || continue; fi
        if [ "$mode" = on ] && [ $first = 1 ]; then
            first=0
            note "daemon processes: $(daemons | tr '\n' ';')"
            note "server list: $(echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=.run/mps/pipe nvidia-cuda-mps-control 2>&1)"
            make --no-print-directory verify > "$out/verify-mps.txt" 2>&1 && note "verify under MPS: exit 0" \
                || fail "verify under MPS exit $?"
            tail -12 "$out/verify-mps.txt" >> "$checks"
        fi
        load "$label"
        stop "$label"
    done
done
# The default (MPS unset): on for this repository's GPU runner models, and said so.
if serve default ""; then
    grep -q "on by default" "$out/default-serve.txt" || fail "the default serve's ready line does not say MPS is on"
    stop default
fi
note "exit $status"
exit $status
