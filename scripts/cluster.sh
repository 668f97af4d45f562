#!/usr/bin/env bash
# A real SLURM cluster on this machine, for trying multi-node runs before a real cluster (docs/multinode.md).
#
# Every host is a network + UTS + mount namespace: its own hostname, its own address on a private bridge, and its
# own /tmp and /dev/shm. Everything else is shared, as a cluster shares a network file system: keep a run's files
# (the checkout, the environment, output_dir) outside /tmp. The controller (slurmctld) is a host of its own, each
# node runs slurmd, and one munged serves them all through /run/munge. Needs root, iproute2, util-linux and
# Debian's slurmctld, slurmd, slurm-client and munge packages (`make cluster-deps`).
#
#   scripts/cluster.sh up [N]          start N nodes (default 3): node1..nodeN, then wait until sinfo shows them idle
#   scripts/cluster.sh down            stop every process on the cluster's hosts and remove hosts, links and bridge
#   scripts/cluster.sh run HOST CMD..  run CMD on HOST (node1.., ctl, or a host added with `host`)
#   scripts/cluster.sh host NAME       add a bare host on the same network (no slurmd), for what runs beside SLURM
#   scripts/cluster.sh link HOST up|down   plug a host's network link in or pull it out
#   scripts/cluster.sh shape HOST RATE|off limit what reaches HOST to RATE (tc's units: 1mbit), or lift the limit
#   scripts/cluster.sh pids HOST       the processes running on HOST (the machine's process IDs)
#   scripts/cluster.sh env             the variables that point SLURM's commands here: eval "$(scripts/cluster.sh env)"
#   scripts/cluster.sh status          the hosts, their addresses, and sinfo
#
# STARE_CLUSTER_NAME (default stcl) and STARE_CLUSTER_SUBNET (default 10.213.0) let two clusters live side by side;
# STARE_CLUSTER_DIR (default /var/tmp/<name>) holds the configuration, the logs and `shared/`, a scratch directory
# every host sees.
set -euo pipefail

NAME=${STARE_CLUSTER_NAME:-stcl}
SUBNET=${STARE_CLUSTER_SUBNET:-10.213.0}
DIR=${STARE_CLUSTER_DIR:-/var/tmp/$NAME}
BRIDGE=${NAME}br
CTL_ADDR=$SUBNET.254
BRIDGE_ADDR=$SUBNET.253  # this machine's own address on the cluster network
# Network interface names are at most 15 characters: the bridge and the host-side link ends carry the short name.
[[ ${#NAME} -le 8 && $NAME =~ ^[a-z][a-z0-9]*$ ]] || { echo "STARE_CLUSTER_NAME=$NAME: use 1-8 lowercase letters or digits" >&2; exit 2; }

die() { echo "cluster.sh: $*" >&2; exit 1; }
anchor_pid() { cat "$DIR/hosts/$1.pid" 2>/dev/null || die "no host '$1' (hosts: $(ls "$DIR/hosts" 2>/dev/null | sed -n 's/\.pid$//p' | tr '\n' ' '))"; }
# The processes in a network namespace. `ip netns pids` gives up when a process ends while it looks.
netns_pids() {
  local target pid
  target=$(stat -L -c %i "/run/netns/$1" 2>/dev/null) || return 0
  for pid in /proc/[0-9]*; do
    [[ $(stat -L -c %i "$pid/ns/net" 2>/dev/null) == "$target" ]] && echo "${pid#/proc/}"
  done
  return 0
}
on_host() { local pid; pid=$(anchor_pid "$1"); shift; nsenter --target "$pid" --net --uts --mount -- "$@"; }

# A host: a network namespace plugged into the bridge, and a process that holds its UTS and mount namespaces (its
# hostname, a private /tmp and /dev/shm, and /etc/hosts naming every host) for everything later started there.
add_host() {
  local host=$1 addr=$2 netns=$NAME-$1 link=${NAME}-$3
  ip netns add "$netns"
  ip link add "$link" type veth peer name eth0 netns "$netns"
  ip link set "$link" master "$BRIDGE" up
  ip -n "$netns" addr add "$addr/24" dev eth0
  ip -n "$netns" link set eth0 up
  ip -n "$netns" link set lo up
  echo "$link" >"$DIR/hosts/$host.link"
  # `ip netns exec` would remount /sys, hiding the cgroup tree slurmd needs; nsenter enters the network only.
  setsid nsenter --net="/run/netns/$netns" -- unshare --uts --mount --propagation private -- bash -c "
    hostname $host
    mount -t tmpfs -o mode=1777 tmpfs /tmp
    mount -t tmpfs -o mode=1777 tmpfs /dev/shm
    mount --bind $DIR/etc-hosts /etc/hosts
    exec sleep infinity" </dev/null >/dev/null 2>&1 &
  echo $! >"$DIR/hosts/$host.pid"
  # The holder is ready once it sits in a UTS namespace of its own with the new hostname.
  for _ in $(seq 50); do
    [[ $(nsenter --target $! --uts hostname 2>/dev/null) == "$host" ]] && return 0
    sleep 0.1
  done
  die "host $host did not come up"
}

write_config() {
  local n=$1 i
  {
    echo "127.0.0.1 localhost"
    echo "$CTL_ADDR ctl"
    for i in $(seq "$n"); do echo "$SUBNET.$i node$i"; done
  } >"$DIR/etc-hosts"
  # Settings that run in namespaces: process tracking by /proc (no cgroup freezer), no task plugin, no accounting.
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=$NAME
SlurmctldHost=ctl($CTL_ADDR)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
EOF
  for i in $(seq "$n"); do
    echo "NodeName=node$i NodeAddr=$SUBNET.$i CPUs=$(nproc) State=UNKNOWN" >>"$DIR/slurm.conf"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$DIR/slurm.conf"
}

start_munge() {
  [[ -S /run/munge/munge.socket.2 ]] && munge -n </dev/null | unmunge >/dev/null 2>&1 && return 0
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- munged || die "munged did not start"
}

up() {
  local n=${1:-3} i
  [[ $n =~ ^[1-9][0-9]?$ && $n -le 250 ]] || die "up N: N is a node count from 1 to 250, got '$n'"
  [[ $(id -u) == 0 ]] || die "needs root (network namespaces and the SLURM daemons)"
  for tool in slurmctld slurmd sbatch munged; do
    command -v "$tool" >/dev/null || die "$tool is not installed: make cluster-deps (apt-get install slurmctld slurmd slurm-client munge)"
  done
  [[ -e $DIR/hosts ]] && die "a cluster named $NAME is already up (scripts/cluster.sh down first); its files: $DIR"
  mkdir -p "$DIR"/{hosts,state,run,log,shared}
  chmod 1777 "$DIR/shared"
  for i in $(seq "$n"); do mkdir -p "$DIR/spool/node$i"; done  # slurmd fails if its spool directory is missing
  write_config "$n"
  start_munge
  ip link add "$BRIDGE" type bridge
  ip addr add "$BRIDGE_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  add_host ctl "$CTL_ADDR" ctl
  for i in $(seq "$n"); do add_host "node$i" "$SUBNET.$i" "n$i"; done
  on_host ctl slurmctld -f "$DIR/slurm.conf"
  for i in $(seq "$n"); do on_host "node$i" slurmd -f "$DIR/slurm.conf"; done
  for _ in $(seq 100); do
    [[ $(SLURM_CONF=$DIR/slurm.conf sinfo -h -t idle -o %D 2>/dev/null) == "$n" ]] && { echo "cluster $NAME: $n nodes idle"; return 0; }
    sleep 0.2
  done
  die "the nodes did not come up idle within 20 s; see $DIR/log"
}

down() {
  local netns
  # Every namespace of this cluster's name, also those of a cluster whose files are gone (an interrupted run).
  for netns in $(ip netns list | awk '{print $1}' | grep "^$NAME-" || true); do
    # Everything started on the host: daemons, job steps, and the namespace holder itself.
    netns_pids "$netns" | xargs -r kill -9 2>/dev/null || true
    ip netns del "$netns" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf "$DIR/hosts" "$DIR/state" "$DIR/spool" "$DIR/run"
}

case ${1:-} in
  up) shift; up "$@" ;;
  down) down ;;
  run) [[ $# -ge 3 ]] || die "usage: run HOST CMD.."; shift; host=$1; shift; on_host "$host" "$@" ;;
  host)
    [[ $# -eq 2 && $2 =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "usage: host NAME (1-8 lowercase letters or digits)"
    [[ -e $DIR/hosts/$2.pid ]] && die "host $2 exists"
    count=$(ls "$DIR"/hosts/*.link | wc -l)
    addr=$SUBNET.$((200 + count))
    echo "$addr $2" >>"$DIR/etc-hosts"  # in place: every host's /etc/hosts is this file, bound
    add_host "$2" "$addr" "h$count"
    echo "$addr"
    ;;
  link)
    [[ $# -eq 3 && $3 =~ ^(up|down)$ ]] || die "usage: link HOST up|down"
    ip link set "$(cat "$DIR/hosts/$2.link" 2>/dev/null || die "no host '$2'")" "$3"
    ;;
  shape)
    [[ $# -eq 3 && $3 =~ ^(off|[0-9]+[kmg]?bit)$ ]] || die "usage: shape HOST RATE|off (RATE: 1mbit, 500kbit, ...)"
    link=$(cat "$DIR/hosts/$2.link" 2>/dev/null || die "no host '$2'")
    # The host's end of its link sends what the bridge forwards to the host: a token bucket there slows its inbound.
    if [[ $3 == off ]]; then tc qdisc del dev "$link" root 2>/dev/null || true
    else tc qdisc replace dev "$link" root tbf rate "$3" burst 32kbit latency 1s; fi
    ;;
  pids) [[ $# -eq 2 ]] || die "usage: pids HOST"; anchor_pid "$2" >/dev/null; netns_pids "$NAME-$2" ;;
  env) echo "export SLURM_CONF=$DIR/slurm.conf" ;;
  status)
    for f in "$DIR"/hosts/*.pid; do [[ -e $f ]] && echo "$(basename "$f" .pid) pid $(cat "$f")"; done
    SLURM_CONF=$DIR/slurm.conf sinfo
    ;;
  *) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
