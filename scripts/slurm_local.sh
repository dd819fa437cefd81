#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine (docs/SWEEPS.md, "A real SLURM cluster on
# one machine"), for `weight-transfer sweep ... --cluster slurm` and the `slurm`-marked tests.
#
#   bash scripts/slurm_local.sh start     # install if missing, configure, start, wait until idle
#   bash scripts/slurm_local.sh status    # sinfo (and squeue)
#   bash scripts/slurm_local.sh stop      # stop slurmd, slurmctld, munged (by their pid files)
#
# start (as root; idempotent: a running daemon is left alone):
#   - installs the Debian packages slurm-wlm and munge with apt-get, only if slurmctld, slurmd,
#     sbatch or munged is absent (slurm 22.05 on Debian 12);
#   - writes /etc/slurm/slurm.conf (where Debian's slurm looks; SLURM_CONF overrides) for one
#     node, this host (`hostname -s`), in one partition `debug` (Default=YES, MaxTime=INFINITE).
#     The node DECLARES MORE CPUs THAN IT HAS: CPUs=$WT_SLURM_CPUS (default 16) with
#     SlurmdParameters=config_overrides, because one trial job has 1 + n_train + n_infer tasks,
#     one CPU each, and the tasks are mostly waiting on each other (a 2-core box runs them as
#     the local executor would). RealMemory is the real one (MB);
#   - creates a munge key (/etc/munge/munge.key) if there is none;
#   - starts munged, slurmctld and slurmd as root, with state, spool, logs and pid files under
#     $WT_SLURM_DIR (default /var/lib/wt-slurm): state/ spool/ log/{munged,slurmctld,slurmd}.log
#     run/{munged,slurmctld,slurmd}.pid, the munge socket run/munge.socket;
#   - waits (up to $WT_SLURM_WAIT s, default 60) until `sinfo` shows the node idle.
# Exit status 0 when the node is idle; otherwise 1 with one `error:` line on stderr (the logs
# under $WT_SLURM_DIR/log say more).
set -euo pipefail

DIR=${WT_SLURM_DIR:-/var/lib/wt-slurm}
CPUS=${WT_SLURM_CPUS:-16}
WAIT=${WT_SLURM_WAIT:-60}
CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
export PATH="$PATH:/usr/sbin:/sbin"
HOST=$(hostname -s)
RUN=$DIR/run
LOG=$DIR/log
SOCKET=$RUN/munge.socket

die() { echo "error: $*" >&2; exit 1; }
say() { echo "slurm_local: $*" >&2; }

alive() {  # alive PIDFILE: the process named there runs
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        return
    fi
    [[ $(id -u) == 0 ]] || die "slurm-wlm/munge not installed and not root: run as root (apt-get install slurm-wlm munge)"
    command -v apt-get >/dev/null || die "slurm-wlm/munge not installed and no apt-get here"
    say "installing slurm-wlm munge (apt-get)"
    local t0=$SECONDS
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-cache show slurm-wlm >/dev/null 2>&1; then
        apt-get update -q >"$LOG/apt.log" 2>&1 || die "apt-get update failed (see $LOG/apt.log)"
    fi
    # policy-rc.d may forbid (or allow) starting services during install: either way this
    # script starts its own daemons, so the packages' own services are stopped again below
    if ! apt-get install -y -q --no-install-recommends slurm-wlm munge >>"$LOG/apt.log" 2>&1; then
        # stale package lists (a version the mirror no longer has): refresh them once, retry
        apt-get update -q >>"$LOG/apt.log" 2>&1 || die "apt-get update failed (see $LOG/apt.log)"
        apt-get install -y -q --no-install-recommends slurm-wlm munge >>"$LOG/apt.log" 2>&1 \
            || die "apt-get install slurm-wlm munge failed (see $LOG/apt.log)"
    fi
    for svc in slurmd slurmctld munge; do
        command -v systemctl >/dev/null && systemctl stop "$svc" >/dev/null 2>&1 || true
    done
    say "installed in $((SECONDS - t0)) s"
}

write_conf() {
    local mem
    mem=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    mkdir -p "$(dirname "$CONF")"
    local new
    new=$(cat <<EOF
# Written by scripts/slurm_local.sh (weight-transfer): a one-node cluster on this host.
# The node declares CPUs=$CPUS, more than it has ($(nproc)): a trial job runs 1 + n_train +
# n_infer tasks, one CPU each; config_overrides keeps the node usable with fewer real CPUs.
ClusterName=wt-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=30
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
)
    if [[ ! -f $CONF ]] || [[ $(cat "$CONF") != "$new" ]]; then
        printf '%s\n' "$new" >"$CONF"
        CONF_CHANGED=1
    fi
}

munge_key() {
    local key=/etc/munge/munge.key
    if [[ ! -s $key ]]; then
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile="$key" --force >/dev/null 2>&1 || dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
        else
            dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
        fi
    fi
    chown root:root "$key" /etc/munge
    chmod 0400 "$key"
    chmod 0700 /etc/munge
}

start_munged() {
    if alive "$RUN/munged.pid"; then return 0; fi
    rm -f "$SOCKET" "$SOCKET.lock"
    munged --force --socket="$SOCKET" --pid-file="$RUN/munged.pid" --log-file="$LOG/munged.log" \
        --seed-file="$DIR/munged.seed" --key-file=/etc/munge/munge.key 2>>"$LOG/munged.log" \
        || die "munged did not start (see $LOG/munged.log)"
    munge -n -S "$SOCKET" | unmunge -S "$SOCKET" >/dev/null 2>&1 || die "munge round trip failed (see $LOG/munged.log)"
}

start_daemon() {  # start_daemon NAME
    local name=$1
    if alive "$RUN/$name.pid"; then
        if [[ $name == slurmctld && ${CONF_CHANGED:-0} == 1 ]]; then
            scontrol reconfigure >/dev/null 2>&1 || true  # a running cluster picks up a new slurm.conf
        fi
        return 0
    fi
    "$name" -f "$CONF" >>"$LOG/$name.out" 2>&1 || die "$name did not start (see $LOG/$name.log and $LOG/$name.out)"
}

wait_idle() {
    local t0=$SECONDS state="" d
    while (( SECONDS - t0 < WAIT )); do
        for d in slurmctld slurmd; do  # a daemon that exited after daemonizing (port in use, bad node name)
            if (( SECONDS - t0 >= 5 )) && ! alive "$RUN/$d.pid"; then
                die "$d exited: $(grep -E 'error|fatal' "$LOG/$d.log" 2>/dev/null | tail -1 || true) (see $LOG/$d.log)"
            fi
        done
        state=$(sinfo -h -N -n "$HOST" -o %t 2>/dev/null | head -1 || true)
        case $state in
            idle|mix|alloc) say "node $HOST $state ($CPUS CPUs declared, partition debug), $((SECONDS - t0)) s"; return ;;
            down*|drain*|drng*|inval*|fail*)
                # after a restart the node may be down from before; ReturnToService=2 brings it back on
                # registration, an explicit resume covers the rest
                scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 1
    done
    die "node $HOST not idle after $WAIT s (sinfo: ${state:-no answer}; see $LOG/slurmctld.log, $LOG/slurmd.log)"
}

start() {
    [[ $(id -u) == 0 ]] || die "start needs root (it writes $CONF and runs the daemons as root)"
    mkdir -p "$DIR/state" "$DIR/spool" "$RUN" "$LOG"
    install_packages
    write_conf
    munge_key
    start_munged
    start_daemon slurmctld
    start_daemon slurmd
    wait_idle
}

stop_one() {  # stop_one NAME: TERM, then KILL after 15 s
    local pidfile=$RUN/$1.pid pid
    alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
    rm -f "$pidfile"
    say "stopped $1 ($pid)"
}

stop() {
    stop_one slurmd
    stop_one slurmctld
    stop_one munged
}

status() {
    command -v sinfo >/dev/null || die "sinfo not installed (bash scripts/slurm_local.sh start)"
    for d in munged slurmctld slurmd; do
        if alive "$RUN/$d.pid"; then echo "$d running ($(cat "$RUN/$d.pid"))"; else echo "$d not running"; fi
    done
    sinfo || die "sinfo failed: slurmctld not answering"
    squeue
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
