# Helpers shared by the benchmark scripts (sourced, not run).

say() { echo "==> $*" >&2; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# free_port_pair: a free port whose next port is free too (a server that
# binds both, as llm-sim's KV-cache events and their replay socket).
free_port_pair() {
    python3 -c '
import socket
while True:
    a = socket.socket(); a.bind(("127.0.0.1", 0)); p = a.getsockname()[1]
    b = socket.socket()
    try:
        b.bind(("127.0.0.1", p + 1))
    except OSError:
        continue
    print(p)
    break'
}

# wait_http URL: until URL answers 2xx (30 s at most).
wait_http() {
    for _ in $(seq 300); do
        curl -sf -o /dev/null "$1" && return 0
        sleep 0.1
    done
    echo "timed out waiting for $1" >&2
    return 1
}

# wait_eligible MGMT_ADDR N [TENTHS]: until the balancer at MGMT_ADDR has N
# eligible endpoints (TENTHS of a second at most, default 100); fails if not.
wait_eligible() {
    local n=0
    for _ in $(seq "${3:-100}"); do
        n=$(curl -s "$1/api/v1/agents" 2>/dev/null |
            python3 -c 'import json,sys; print(sum(e["eligible"] for e in json.load(sys.stdin)["endpoints"]))' 2>/dev/null || echo 0)
        [ "$n" = "$2" ] && return 0
        sleep 0.1
    done
    return 1
}

# cpu_ticks PID...: user + system time of all of them, in clock ticks
# (getconf CLK_TCK per second); 0 for one that is gone.
cpu_ticks() {
    local t=0 p
    for p in "$@"; do
        t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
    done
    echo "$t"
}

# start_reported_fleet BIN N MGMT_ADDR LOG [LLM_SIM_ARGS...]: one llm-sim on
# core 1 serving N simulated servers (64 slots each) and reporting each to
# the balancer's management port at MGMT_ADDR as its agent would; appends
# its pid to `pids` and waits until all N are eligible (fails otherwise).
start_reported_fleet() {
    local bin=$1 n=$2 mgmt=$3 log=$4
    shift 4
    taskset -c 1 "$bin/llm-sim" --listen 127.0.0.1:0 --servers "$n" --slots 64 --threads 1 \
        --report-to "http://$mgmt" "$@" >/dev/null 2>"$log" &
    pids+=($!)
    wait_eligible "$mgmt" "$n" 300 || { echo "$n simulated endpoints did not all become eligible" >&2; return 1; }
}

# venv_install VENV PACKAGE MODULE: pip-installs PACKAGE into VENV unless
# MODULE imports there; succeeds when it does.
venv_install() {
    if ! "$1/bin/python" -c "import $3" 2>/dev/null; then
        say "installing $2 into $1"
        python3 -m venv "$1" >/dev/null 2>&1 && "$1/bin/pip" install -q "$2" >/dev/null 2>&1 || true
    fi
    "$1/bin/python" -c "import $3" 2>/dev/null
}

# target_dir: where cargo puts its builds (CARGO_TARGET_DIR, a
# build.target-dir setting, or ./target), asked of cargo itself.
target_dir() {
    cargo metadata --format-version 1 --no-deps |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])'
}
