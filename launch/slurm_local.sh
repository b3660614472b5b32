#!/bin/bash
# A throw-away SLURM cluster on this machine, to try the sbatch wrappers without a real cluster.
#
#   sudo launch/slurm_local.sh start            # one node: this machine's CPUs and memory
#   export SLURM_CONF=/tmp/slurm-local/slurm.conf
#   NGPU=2 sbatch --gpus-per-node=0 --cpus-per-task=2 launch/slurm_1node.sbatch configs/tiny_cpu.yaml
#   squeue; scontrol show job JOBID
#   sudo launch/slurm_local.sh stop             # cancels its jobs, stops the daemons it started
#
# Debian/Ubuntu, as root: installs SLURM (slurmctld, slurmd and slurm-client, the parts of Debian's
# slurm-wlm used here) and munge with apt-get when they are missing. Everything else lives in
# SLURM_LOCAL_DIR: slurm.conf, a munge key and socket of its own (a munged already running on the
# machine is left alone), state, logs, and `pids`, the daemons `stop` ends, by pid.
# `start NODES` with NODES > 1 asks for several slurmd on this host (distinct node names and ports);
# that needs a SLURM built with --enable-multiple-slurmd, and the script says so when it is not.
# Node names are host names that resolve here (this machine's, then localhost): torchrun's
# rendezvous connects to the first node by name.
#
# Environment [default]:
#   SLURM_LOCAL_DIR   [/tmp/slurm-local]
#   SLURMCTLD_PORT    [6817]; slurmd k listens on SLURMD_PORT + k [6818]
#   SLURM_LOCAL_CPUS  CPUs per node [nproc]

set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/slurm-local}
CTLD_PORT=${SLURMCTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF

die() { echo "slurm_local.sh: $*" >&2; exit 1; }

install_packages() {
  local cmd missing=0
  for cmd in slurmctld slurmd sbatch munged; do command -v "$cmd" >/dev/null || missing=1; done
  ((missing)) || return 0
  [[ $(id -u) == 0 ]] || die "SLURM and munge are not installed; run as root to install them"
  # The daemons and clients of Debian's slurm-wlm, without the plugins this cluster does not use.
  local packages=(slurmctld slurmd slurm-client munge)
  echo "installing ${packages[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # The package lists may be missing on a fresh machine: refresh them once if the first try fails.
  apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null ||
    { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null; }
}

# The node names: host names of this machine (NODES of them), each resolving to it.
node_names() {
  local host names=()
  for host in "$(hostname -s)" localhost; do
    getent hosts "$host" >/dev/null && [[ ! " ${names[*]} " =~ \ $host\  ]] && names+=("$host")
  done
  (( ${#names[@]} >= $1 )) || die "cannot run $1 nodes on this host: they need $1 names of it, found ${names[*]}"
  printf '%s\n' "${names[@]:0:$1}"
}

write_conf() {  # write_conf NODE_NAME...
  local cpus mem_mb k=0 name
  cpus=${SLURM_LOCAL_CPUS:-$(nproc)}
  # Slurm drains a node whose RealMemory exceeds what slurmd finds: stay a little under MemTotal.
  mem_mb=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.95 }' /proc/meminfo)
  cat >"$CONF" <<EOF
ClusterName=local
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/slurmd-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
# No cgroups (containers often cannot use them): processes tracked by parent id, tasks not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
MinJobAge=600
EOF
  for name in "$@"; do
    echo "NodeName=$name NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + k))" \
      "CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN" >>"$CONF"
    k=$((k + 1))
  done
  echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
}

# Start a daemon in the foreground of a background job, its output in a log; record its pid.
spawn() {
  local log=$1
  shift
  setsid "$@" >>"$log" 2>&1 </dev/null &
  echo "$! $1" >>"$DIR/pids"
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...: poll COMMAND until it succeeds
  local timeout=$1 deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      stop >&2
      die "$what not ready after ${timeout}s; logs in $DIR"
    fi
    sleep 0.5
  done
}

nodes_idle() {  # every node idle (registered and free)
  local states
  states=$(sinfo -h -N -o %T)
  [[ -n $states ]] && ! grep -qv '^idle$' <<<"$states"
}

start() {
  local nodes=${1:-1} names name
  [[ $(id -u) == 0 ]] || die "run as root: slurmd starts jobs as their users"
  [[ ! -s $DIR/pids ]] || die "$DIR/pids lists running daemons; run '$0 stop' first"
  install_packages
  names=$(node_names "$nodes")
  if [[ -d $DIR && -n $(ls -A "$DIR") && ! -f $CONF ]]; then
    die "$DIR is not empty and holds no slurm.conf: not ours, set SLURM_LOCAL_DIR elsewhere"
  fi
  rm -rf "$DIR"
  mkdir -p "$DIR/ctld"
  chmod 755 "$DIR"  # readable slurm.conf and munge socket: other users can submit too
  # shellcheck disable=SC2086  # one name per word
  write_conf $names

  # munge: a key and a socket of our own.
  dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
  chmod 400 "$DIR/munge.key"
  spawn "$DIR/munged.out" munged --foreground --force --socket="$DIR/munge.socket" --key-file="$DIR/munge.key" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed"
  wait_for 20 munged test -S "$DIR/munge.socket"

  spawn "$DIR/slurmctld.out" slurmctld -D -c -i -f "$CONF"
  wait_for 30 slurmctld scontrol ping
  # (Not `scontrol ... | grep -q`: under pipefail, grep leaving early can fail scontrol with SIGPIPE.)
  if ((nodes > 1)) && [[ ! $(scontrol show config) =~ MULTIPLE_SLURMD\ *=\ *Yes ]]; then
    stop >&2
    die "cannot run $nodes nodes on this host: that needs a SLURM built with --enable-multiple-slurmd," \
      "and this one ($(slurmd -V)) is not. Start 1 node, or build SLURM with that option."
  fi
  for name in $names; do
    mkdir -p "$DIR/slurmd-$name"
    spawn "$DIR/slurmd-$name.out" slurmd -D -N "$name" -f "$CONF"
  done
  wait_for 60 "the node(s)" nodes_idle
  sinfo -N -o "%N %T %c %m"
  echo "SLURM is up. Point the clients at it:  export SLURM_CONF=$CONF"
}

# Is PID still the daemon NAME that we started (and not a later process that got its pid)?
alive() { [[ $(cat "/proc/$1/comm" 2>/dev/null) == "$2" ]]; }

stop() {
  [[ -f $DIR/pids ]] || { echo "nothing to stop in $DIR"; return; }
  local ids pid name
  # Cancel our jobs first, so that slurmstepd ends their processes before the daemons go.
  read -r pid name < <(grep ' slurmctld$' "$DIR/pids") || true
  if [[ -n ${pid:-} ]] && alive "$pid" slurmctld; then
    ids=$(squeue -h -o %i 2>/dev/null || true)
    if [[ -n $ids ]]; then
      # shellcheck disable=SC2086  # one id per word
      scancel $ids || true
      for _ in $(seq 30); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.5; done
    fi
  fi
  # The daemons: SIGTERM to all at once (each takes a second or two to exit), SIGKILL after 10 s.
  while read -r pid name; do ! alive "$pid" "$name" || kill "$pid"; done <"$DIR/pids"
  while read -r pid name; do
    for _ in $(seq 40); do alive "$pid" "$name" || continue 2; sleep 0.25; done
    echo "$name ($pid) ignored SIGTERM for 10 s; killing it" >&2
    kill -9 "$pid" 2>/dev/null || true
  done <"$DIR/pids"
  rm -f "$DIR/pids"
  echo "stopped the daemons started from $DIR"
}

case ${1:-} in
  start) start "${2:-1}" ;;
  stop) stop ;;
  *) die "usage: $0 start [NODES] | stop" ;;
esac
