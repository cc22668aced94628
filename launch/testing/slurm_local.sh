#!/usr/bin/env bash
# A real two-node Slurm on this one machine, for tests: munge + slurmctld + two slurmd (n1, n2).
#   slurm_local.sh up      start (idempotent); prints `export SLURM_CONF=...` for the caller
#   slurm_local.sh down    stop only the daemons this script started (by pid file), undo /etc/hosts
#   slurm_local.sh status
# Needs root and: apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
set -euo pipefail

DIR=${SHARDLIGHT_SLURM_DIR:-/tmp/shardlight-slurm}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)
HOSTS_MARK="# shardlight-slurm-test"

require() {
    for tool in slurmctld slurmd sbatch scontrol munged; do
        command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || {
            echo "slurm_local: $tool not installed (apt-get install slurmctld slurmd slurm-client munge)" >&2; exit 3; }
    done
    [ "$(id -u)" = 0 ] || { echo "slurm_local: needs root" >&2; exit 3; }
}

write_conf() {
    mkdir -p "$DIR/ctld" "$DIR/gres"
    for node in n1 n2; do mkdir -p "$DIR/spool-$node"; : > "$DIR/gres/$node-gpu0"; done
    cat > "$CONF" <<CONF
ClusterName=shardlight
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=16817
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
KillOnBadExit=1
ReturnToService=2
MpiDefault=none
GresTypes=gpu
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001 CPUs=1 RealMemory=4000 Gres=gpu:1 State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17002 CPUs=1 RealMemory=4000 Gres=gpu:1 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
    cat > "$DIR/gres.conf" <<GRES
NodeName=n1 Name=gpu File=$DIR/gres/n1-gpu0
NodeName=n2 Name=gpu File=$DIR/gres/n2-gpu0
GRES
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

up() {
    require
    mkdir -p "$DIR"
    write_conf
    # Jobs use the node names as MASTER_ADDR, so they must resolve.
    grep -q "$HOSTS_MARK" /etc/hosts || echo "127.0.0.1 n1 n2 $HOSTS_MARK" >> /etc/hosts
    if ! alive "$DIR/munged.pid"; then
        mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
        [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
        chmod 400 /etc/munge/munge.key
        runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
        cp /run/munge/munged.pid "$DIR/munged.pid"
    fi
    export SLURM_CONF=$CONF
    alive "$DIR/slurmctld.pid" || /usr/sbin/slurmctld -f "$CONF" -i
    for node in n1 n2; do
        alive "$DIR/slurmd-$node.pid" || /usr/sbin/slurmd -f "$CONF" -N "$node"
    done
    for _ in $(seq 1 60); do
        if sinfo -h -o '%T' 2>/dev/null | grep -qx idle && [ "$(sinfo -h -N -o '%T' | grep -c idle)" = 2 ]; then
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        sleep 0.5
    done
    echo "slurm_local: nodes did not become idle; see $DIR/*.log" >&2
    sinfo -N >&2 || true
    exit 4
}

down() {
    for pidfile in "$DIR"/slurmd-n1.pid "$DIR"/slurmd-n2.pid "$DIR"/slurmctld.pid "$DIR"/munged.pid; do
        if alive "$pidfile"; then kill "$(cat "$pidfile")" 2>/dev/null || true; fi
        rm -f "$pidfile"
    done
    if grep -q "$HOSTS_MARK" /etc/hosts; then
        grep -v "$HOSTS_MARK" /etc/hosts > /tmp/hosts.shardlight && cat /tmp/hosts.shardlight > /etc/hosts
    fi
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) SLURM_CONF=$CONF sinfo -N ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
