#!/usr/bin/env bash
# A multi-node Ray cluster on one machine: one head plus N worker "nodes", each with its own raylet, so
# placement, node loss and elastic restarts behave as on a real cluster.
#
#   deploy/local_cluster.sh start [--workers N] [--cpus C] [--gpus G] [--dir DIR]
#   d9d train job.yaml --address "$(cat DIR/address)"          # or: d9d submit job.yaml --address http://...
#   deploy/local_cluster.sh kill-node I [--dir DIR]            # lose worker node I (1-based): a failover drill
#   deploy/local_cluster.sh add-node [--cpus C] [--gpus G] [--dir DIR]
#   deploy/local_cluster.sh stop [--dir DIR]
#
# Every process is started here and stopped by its recorded pid (never `ray stop`, which would stop every
# Ray on the machine). The head has no CPUs for ranks; the d9d coordinator needs none.
set -euo pipefail

COMMAND=${1:-start}
shift || true
WORKERS=2
CPUS=2
GPUS=0
DIR=${TMPDIR:-/tmp}/d9d-local-cluster
NODE=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workers) WORKERS=$2; shift 2 ;;
    --cpus) CPUS=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    [0-9]*) NODE=$1; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python}
RAY=${RAY:-ray}
# Ray >= 2.5x enables token authentication once ~/.ray/auth_token exists; every client (ray, d9d submit)
# then needs RAY_AUTH_MODE=token as well. Set RAY_AUTH_MODE=disabled to opt out.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
# Notice a lost node within ~3 s (docs/deploy.md).
export RAY_health_check_period_ms=${RAY_health_check_period_ms:-1000}
export RAY_health_check_failure_threshold=${RAY_health_check_failure_threshold:-3}

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

agent_ports() {
  echo "--dashboard-agent-listen-port=$(free_port) --dashboard-agent-grpc-port=$(free_port) --metrics-export-port=$(free_port)"
}

wait_started() {  # $1: pid of a `ray start --block`, $2: its log; it prints this once the node is up
  for _ in $(seq 1 600); do
    grep -q "will now block forever" "$2" 2>/dev/null && return 0
    kill -0 "$1" 2>/dev/null || { tail -n 5 "$2" >&2; return 1; }
    sleep 0.5
  done
  echo "node did not come up; see $2" >&2
  return 1
}

start_worker() {  # $1: index; one at a time, so a busy machine does not time raylets out
  # Emptied here, not by the background job's redirection: that one may run after wait_started has already
  # read the previous start's log and found its "will now block forever".
  : >"$DIR/worker-$1.log"
  # shellcheck disable=SC2046
  setsid "$RAY" start --address="$(cat "$DIR/address")" --num-cpus="$CPUS" --num-gpus="$GPUS" --block \
    $(agent_ports) >"$DIR/worker-$1.log" 2>&1 &
  echo $! >"$DIR/worker-$1.pid"
  wait_started "$(cat "$DIR/worker-$1.pid")" "$DIR/worker-$1.log"
}

case "$COMMAND" in
  start)
    mkdir -p "$DIR"
    if [[ -f "$DIR/head.pid" ]] && kill -0 "$(cat "$DIR/head.pid")" 2>/dev/null; then
      echo "a cluster is already running from $DIR; stop it first" >&2
      exit 1
    fi
    GCS=$(free_port)
    DASHBOARD=$(free_port)
    : >"$DIR/head.log"  # as in start_worker
    # shellcheck disable=SC2046
    setsid "$RAY" start --head --port="$GCS" --dashboard-port="$DASHBOARD" --dashboard-host=127.0.0.1 \
      --ray-client-server-port="$(free_port)" --num-cpus=0 --num-gpus=0 --block --disable-usage-stats \
      $(agent_ports) >"$DIR/head.log" 2>&1 &
    echo $! >"$DIR/head.pid"
    echo "127.0.0.1:$GCS" >"$DIR/address"
    echo "http://127.0.0.1:$DASHBOARD" >"$DIR/dashboard"
    wait_started "$(cat "$DIR/head.pid")" "$DIR/head.log"
    for i in $(seq 1 "$WORKERS"); do start_worker "$i"; done
    echo "Ray cluster: head + $WORKERS worker nodes ($CPUS CPUs, $GPUS GPUs each)"
    echo "  address:   $(cat "$DIR/address")      (d9d train ... --address / RAY_ADDRESS)"
    echo "  dashboard: $(cat "$DIR/dashboard")   (d9d submit/status/logs/stop --address)"
    echo "  auth:      export RAY_AUTH_MODE=$RAY_AUTH_MODE"
    ;;
  add-node)
    n=$(find "$DIR" -name 'worker-*.log' | wc -l)  # logs outlive killed nodes: indices stay unique
    start_worker $((n + 1))
    echo "started worker node $((n + 1))"
    ;;
  kill-node)
    [[ -n "$NODE" ]] || { echo "which node? kill-node I" >&2; exit 2; }
    pid=$(cat "$DIR/worker-$NODE.pid")
    # A crash, not a drain: SIGKILL the node's whole process group (ray start, raylet, workers, actors).
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$DIR/worker-$NODE.pid"
    echo "worker node $NODE (process group $pid) killed"
    ;;
  stop)
    for f in "$DIR"/worker-*.pid "$DIR/head.pid"; do
      [[ -f "$f" ]] || continue
      pid=$(cat "$f")
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
      kill -KILL -- "-$pid" 2>/dev/null || true  # whatever its session left behind
      rm -f "$f"
    done
    echo "stopped"
    ;;
  *)
    echo "usage: $0 start|add-node|kill-node I|stop [--workers N] [--cpus C] [--gpus G] [--dir DIR]" >&2
    exit 2
    ;;
esac
