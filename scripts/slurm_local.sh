#!/usr/bin/env bash
# A real Slurm cluster on this one machine: munge, one slurmctld and two emulated nodes
# (two slurmd, `slurmd -N node1|node2`, each on its own port, NodeAddr=127.0.0.1).
#
#   scripts/slurm_local.sh ensure   install Debian's packages where root and apt are there (else quiet)
#   scripts/slurm_local.sh start    write the configuration and start the daemons (waits for both nodes)
#   scripts/slurm_local.sh stop     stop every daemon, job step and task; nothing is left, no zombie
#   scripts/slurm_local.sh status   the daemons' pids and `sinfo`; exit 1 when the cluster is not up
#   scripts/slurm_local.sh revive   start again the daemons that died (a node's slurmd killed on purpose)
#   scripts/slurm_local.sh env      the line to eval so that sbatch/srun/squeue find this cluster
#
# The daemons run in the foreground under scripts/slurm_reaper.py (a child subreaper), which reaps
# them and everything they start. State, logs and the configuration live in $GPUFLEET_SLURM_DIR
# (default /tmp/gpufleet-slurm); client commands find the cluster through SLURM_CONF.
# Ports: $GPUFLEET_SLURM_PORT (default 16817) for slurmctld, the next two for the nodes.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
STATE=${GPUFLEET_SLURM_DIR:-/tmp/gpufleet-slurm}
PORT=${GPUFLEET_SLURM_PORT:-16817}
CONF=$STATE/slurm.conf
NODES=(node1 node2)
# Seconds a job of the default partition gets between the preemption signal (SIGTERM) and SIGKILL
# when a job of the "urgent" partition takes its nodes.
GRACE=${GPUFLEET_SLURM_GRACE_S:-30}
# GPUs each emulated node offers as GRES (`--gpus-per-node`): the machine's NVIDIA devices, which
# both nodes share (one host); $GPUFLEET_SLURM_GPUS overrides the count, 0 for none.
gpu_files() { { ls /dev/nvidia[0-9]* 2>/dev/null || true; } | sort -V; }
GPUS=${GPUFLEET_SLURM_GPUS:-$(gpu_files | wc -l)}
PY=/usr/bin/python3
[ -x "$PY" ] || PY=$(command -v python3)

have_slurm() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null; }

ensure() {
  have_slurm && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    return 0  # the Slurm tests skip and say why
  fi
  echo "slurm_local: installing slurmctld slurmd slurm-client munge" >&2
  apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
    || echo "slurm_local: could not install Slurm's packages; the Slurm tests will skip" >&2
}

running() { [ -f "$STATE/reaper.pid" ] && kill -0 "$(cat "$STATE/reaper.pid")" 2>/dev/null; }

write_conf() {
  local host cpus
  host=$(hostname -s)
  cpus=$(nproc)
  mkdir -p "$STATE/munge" "$STATE/ctld" "$STATE/spool"
  chmod 700 "$STATE" "$STATE/munge"
  [ -f "$STATE/munge/munge.key" ] || mungekey --create --keyfile="$STATE/munge/munge.key" >/dev/null
  local PLUGIN_LINE="" GRES_LINE="" NODE_GRES=""
  # Slurm unpacked somewhere else than /usr (its plugins beside it)
  [ -n "${GPUFLEET_SLURM_PLUGIN_DIR:-}" ] && PLUGIN_LINE="PluginDir=$GPUFLEET_SLURM_PLUGIN_DIR"$'\n'
  # Without systemd or dbus (a container) slurmd makes its cgroup folders itself; nothing is constrained
  printf '%s\n' CgroupPlugin=autodetect IgnoreSystemd=yes ConstrainCores=no ConstrainRAMSpace=no \
    ConstrainDevices=no >"$STATE/cgroup.conf"
  # (cgroup v2 without systemd: the slice slurmd puts its step daemons in)
  if [ -f /sys/fs/cgroup/cgroup.controllers ]; then mkdir -p /sys/fs/cgroup/system.slice 2>/dev/null || true; fi
  rm -f "$STATE/gres.conf"
  if [ "$GPUS" -gt 0 ]; then
    GRES_LINE="GresTypes=gpu"$'\n'
    NODE_GRES="Gres=gpu:$GPUS "
    gpu_files | head -n "$GPUS" | sed 's/^/NodeName=node[1-2] Name=gpu File=/' >"$STATE/gres.conf"
  fi
  chmod 600 "$STATE/munge/munge.key"
  cat >"$CONF" <<EOF
ClusterName=gpufleet-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket
CommunicationParameters=NoInAddrAny
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/ctld/slurmctld.pid
SlurmdPidFile=$STATE/spool/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
KillWait=3
InactiveLimit=0
MinJobAge=600
JobRequeue=1
SrunPortRange=60001-60999
${PLUGIN_LINE}${GRES_LINE}NodeName=node1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=$cpus RealMemory=1000 ${NODE_GRES}State=UNKNOWN
NodeName=node2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=$cpus RealMemory=1000 ${NODE_GRES}State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=1 PreemptMode=CANCEL GraceTime=$GRACE
PartitionName=urgent Nodes=node[1-2] Default=NO MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=2 PreemptMode=OFF
EOF
}

start() {
  if running; then
    echo "slurm_local: already running (state in $STATE)"
    return 0
  fi
  have_slurm || { echo "slurm_local: Slurm is not installed (scripts/slurm_local.sh ensure, as root)" >&2; exit 2; }
  stop_quiet
  write_conf
  rm -f "$STATE/reaper.log"
  local args=("$STATE" -- munged munged -F -f --socket="$STATE/munge/munge.socket" --key-file="$STATE/munge/munge.key"
    --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/munged.seed"
    -- slurmctld slurmctld -D -i -f "$CONF")
  for n in "${NODES[@]}"; do
    mkdir -p "$STATE/spool/$n"
    args+=(-- "slurmd-$n" slurmd -D -N "$n" -f "$CONF")
  done
  SLURM_CONF=$CONF setsid "$PY" "$HERE/slurm_reaper.py" "${args[@]}" </dev/null >>"$STATE/reaper.out" 2>&1 &
  local deadline=$((SECONDS + 60))
  until [ "$(SLURM_CONF=$CONF sinfo -h -N -p debug -o '%N %T' 2>/dev/null | grep -cE 'idle|mixed|alloc')" = "${#NODES[@]}" ]; do
    if [ $SECONDS -gt $deadline ] || ! running || grep -q exited "$STATE/reaper.log" 2>/dev/null; then
      echo "slurm_local: the cluster did not come up; logs in $STATE" >&2
      for f in "$STATE"/*.log; do tail -n 5 "$f" >&2; done
      stop_quiet
      exit 1
    fi
    sleep 0.2
  done
  echo "slurm_local: up (nodes ${NODES[*]}); export SLURM_CONF=$CONF"
}

stop_quiet() {
  if [ -f "$STATE/reaper.pid" ]; then
    local pid
    pid=$(cat "$STATE/reaper.pid")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid"
      for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$STATE/reaper.pid"
  fi
}

stop() {
  stop_quiet
  rm -rf "$STATE/ctld" "$STATE/spool"  # no job survives into the next start
  echo "slurm_local: stopped"
}

revive() {
  running || { echo "slurm_local: not running" >&2; exit 1; }
  kill -USR1 "$(cat "$STATE/reaper.pid")"
  local deadline=$((SECONDS + 60))
  for n in "${NODES[@]}"; do
    until SLURM_CONF=$CONF scontrol update NodeName="$n" State=RESUME 2>/dev/null \
        || SLURM_CONF=$CONF sinfo -h -N -n "$n" -o %T | grep -qE '^(idle|mixed|alloc)'; do
      [ $SECONDS -lt $deadline ] || { echo "slurm_local: $n did not come back" >&2; exit 1; }
      sleep 0.5
    done
  done
  until [ "$(SLURM_CONF=$CONF sinfo -h -N -p debug -o '%T' | grep -cE '^(idle|mixed|alloc)')" = "${#NODES[@]}" ]; do
    [ $SECONDS -lt $deadline ] || { echo "slurm_local: the nodes did not come back: $(SLURM_CONF=$CONF sinfo -h -N)" >&2; exit 1; }
    sleep 0.5
  done
  echo "slurm_local: every daemon runs"
}

status() {
  if ! running; then
    echo "slurm_local: not running"
    exit 1
  fi
  echo "reaper pid $(cat "$STATE/reaper.pid"); SLURM_CONF=$CONF"
  for f in "$STATE"/munged.pid "$STATE"/slurmctld.pid "$STATE"/slurmd-*.pid; do
    [ -f "$f" ] || continue
    local name pid
    name=$(basename "$f" .pid)
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then echo "$name: pid $pid"; else echo "$name: DEAD (was pid $pid)"; fi
  done
  SLURM_CONF=$CONF sinfo -N
}

case "${1:-}" in
  ensure) ensure ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  revive) revive ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 ensure|start|stop|status|revive|env" >&2; exit 2 ;;
esac
