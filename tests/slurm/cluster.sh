#!/usr/bin/env bash
# A real two-node Slurm on this one machine, for the tests of examples/slurm/.
#
#   bash tests/slurm/cluster.sh up      # install (apt) if needed, start; prints SLURM_CONF=...
#   bash tests/slurm/cluster.sh down    # stop everything `up` started and undo its changes
#
# Nodes n1 and n2 are slurmd daemons in network + UTS namespaces of their own (mln1, mln2:
# hostnames n1, n2, addresses 10.77.0.11 and .12 on a bridge mlbr0 = 10.77.0.1); the
# controller (hostname mlctl) runs beside them in the root network namespace, one munged
# serves all. /etc/hosts gets three tagged lines, removed by `down`. Nothing but these
# addresses and loopback is used. Needs root. Exit status 77: not possible on this machine
# (the one-line reason is on stderr); any other non-zero status is a failure.
#
# MEGATRON_LITE_SLURM_ROOT (default /tmp/megatron_lite_slurm) holds the configuration, state,
# logs and pid files.
set -euo pipefail

ROOT=${MEGATRON_LITE_SLURM_ROOT:-/tmp/megatron_lite_slurm}
BRIDGE=mlbr0
BRIDGE_ADDR=10.77.0.1
NODES=(n1 n2)
NODE_ADDRS=(10.77.0.11 10.77.0.12)
CTL_HOST=mlctl
CTL_PORT=16817
SLURMD_PORT=16818
CPUS_PER_NODE=8  # more than the cores, so several ranks fit on a node (config_overrides)
HOSTS_TAG="# megatron_lite tests/slurm"
PACKAGES=(slurmctld slurmd slurm-client munge)

skip() {
    echo "cluster.sh: cannot run a Slurm cluster here: $*" >&2
    exit 77
}

die() {
    echo "cluster.sh: error: $*" >&2
    exit 1
}

log() {
    echo "cluster.sh: $*" >&2
}

pid_of() {  # the live process named by a pid file, or nothing
    local pid
    [[ -s $1 ]] || return 0
    pid=$(<"$1")
    if kill -0 "$pid" 2>/dev/null; then
        echo "$pid"
    fi
}

require_root_and_tools() {
    [[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces, daemons, /etc/hosts); running as uid $(id -u)"
    local tool
    for tool in ip unshare nsenter runuser; do
        command -v "$tool" >/dev/null || skip "'$tool' is not installed"
    done
}

install_packages() {
    local missing=() cmd
    for cmd in slurmctld slurmd sbatch munged; do
        command -v "$cmd" >/dev/null || missing+=("$cmd")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    command -v apt-get >/dev/null || skip "Slurm is not installed (${missing[*]} missing) and there is no apt-get to install ${PACKAGES[*]}"
    log "installing ${PACKAGES[*]} (apt-get)"
    local out
    if ! out=$(apt-get update -q 2>&1); then
        skip "apt-get update failed: $(tail -n1 <<<"$out")"
    fi
    if ! out=$(DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" 2>&1); then
        skip "apt-get install ${PACKAGES[*]} failed: $(tail -n1 <<<"$out")"
    fi
    [[ -s /etc/munge/munge.key ]] || die "the munge package left no /etc/munge/munge.key"
}

in_use() {
    [[ -n $(pid_of "$ROOT/run/slurmctld.pid") ]]
}

write_slurm_conf() {
    local memory
    memory=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n1)
    memory=$(( (${memory:-4096} - 1024) / ${#NODES[@]} ))
    {
        echo "ClusterName=megatronlite"
        echo "SlurmctldHost=$CTL_HOST($BRIDGE_ADDR)"
        echo "SlurmctldPort=$CTL_PORT"
        echo "SlurmdPort=$SLURMD_PORT"
        echo "SlurmUser=root"
        echo "AuthType=auth/munge"
        # cred_expire: a requeued job may start again only after its old credential expires
        # (default 120 s); the requeue test would otherwise wait two minutes.
        echo "AuthInfo=socket=$ROOT/munge/munge.socket.2,cred_expire=10"
        echo "CredType=cred/munge"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "MailProg=/bin/true"
        echo "ReturnToService=2"
        echo "SchedulerParameters=batch_sched_delay=0"
        echo "SlurmdParameters=config_overrides"
        echo "KillWait=10"
        echo "StateSaveLocation=$ROOT/state"
        echo "SlurmdSpoolDir=$ROOT/spool/%n"
        echo "SlurmctldPidFile=$ROOT/run/slurmctld.pid"
        echo "SlurmdPidFile=$ROOT/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=$ROOT/log/slurmctld.log"
        echo "SlurmdLogFile=$ROOT/log/slurmd-%n.log"
        local i
        for i in "${!NODES[@]}"; do
            echo "NodeName=${NODES[$i]} NodeAddr=${NODE_ADDRS[$i]} CPUs=$CPUS_PER_NODE RealMemory=$memory State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } >"$ROOT/slurm.conf"
}

start_munge() {
    mkdir -p "$ROOT/munge"
    chown munge: "$ROOT/munge"
    chmod 755 "$ROOT/munge"  # munged wants its socket's folder open to every user
    runuser -u munge -- munged --key-file=/etc/munge/munge.key --socket="$ROOT/munge/munge.socket.2" \
        --pid-file="$ROOT/munge/munged.pid" --log-file="$ROOT/munge/munged.log" \
        --seed-file="$ROOT/munge/munged.seed" || die "munged did not start (see above)"
}

start_network() {
    ip link add "$BRIDGE" type bridge || skip "cannot create a bridge (ip link add $BRIDGE type bridge failed)"
    ip addr add "$BRIDGE_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local i ns
    for i in "${!NODES[@]}"; do
        ns=ml${NODES[$i]}
        ip netns add "$ns" || skip "cannot create network namespaces (ip netns add $ns failed)"
        ip link add "mlv${NODES[$i]}" type veth peer name mleth0 netns "$ns"
        ip link set "mlv${NODES[$i]}" master "$BRIDGE" up
        ip -n "$ns" addr add "${NODE_ADDRS[$i]}/24" dev mleth0
        ip -n "$ns" link set mleth0 up
        ip -n "$ns" link set lo up
    done
    # Every process resolves the node names to these addresses; torchrun's rendezvous and gloo need it.
    local hosts
    hosts=$(printf '%s %s %s\n' "$BRIDGE_ADDR" "$CTL_HOST" "$HOSTS_TAG"
            for i in "${!NODES[@]}"; do printf '%s %s %s\n' "${NODE_ADDRS[$i]}" "${NODES[$i]}" "$HOSTS_TAG"; done)
    if [[ -s /etc/hosts && -n $(tail -c1 /etc/hosts) ]]; then
        touch "$ROOT/hosts-lacked-final-newline"  # so `down` gives back the file as it was
        echo >>/etc/hosts
    fi
    echo "$hosts" >>/etc/hosts
}

start_slurm() {
    local node
    # slurmctld must run under the hostname SlurmctldHost names; a UTS namespace gives it one.
    unshare --uts sh -c "hostname $CTL_HOST && exec slurmctld -i -f '$ROOT/slurm.conf'"
    for node in "${NODES[@]}"; do
        # nsenter, not `ip netns exec`: that remounts /sys, and slurmd then finds no cgroup fs.
        nsenter --net="/run/netns/ml$node" unshare --uts \
            sh -c "hostname $node && exec slurmd -N $node -f '$ROOT/slurm.conf'"
    done
}

wait_for_nodes() {
    local deadline=$((SECONDS + 60)) idle
    while ((SECONDS < deadline)); do
        idle=$(SLURM_CONF=$ROOT/slurm.conf sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
        if [[ $idle -eq ${#NODES[@]} ]]; then
            return 0
        fi
        sleep 0.3
    done
    die "the nodes did not become idle within 60 s; see $ROOT/log/"
}

undo_failed_up() {  # a start that stopped part-way leaves nothing running, after showing its logs
    (($1 == 0)) && return 0
    local f
    for f in "$ROOT"/log/*.log "$ROOT"/munge/munged.log; do
        [[ -s $f ]] && { echo "--- $f" && tail -n 20 "$f"; } >&2
    done
    down_quietly
}

up() {
    require_root_and_tools
    install_packages
    if in_use; then
        die "a cluster is already running from $ROOT (run '$0 down' first)"
    fi
    down_quietly
    trap 'undo_failed_up $?' EXIT
    mkdir -p "$ROOT"/{state,spool,run,log}
    write_slurm_conf
    start_munge
    start_network
    start_slurm
    wait_for_nodes
    trap - EXIT
    log "up: nodes ${NODES[*]} idle"
    echo "SLURM_CONF=$ROOT/slurm.conf"
}

kill_pidfile() {
    local pid
    pid=$(pid_of "$1")
    [[ -n $pid ]] || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
}

down_quietly() {
    local node ns pids
    if [[ -n $(pid_of "$ROOT/run/slurmctld.pid") ]]; then
        SLURM_CONF=$ROOT/slurm.conf scancel --full --quiet --state=RUNNING --signal=KILL --user=root 2>/dev/null || true
        SLURM_CONF=$ROOT/slurm.conf scancel --quiet --user=root 2>/dev/null || true
    fi
    for node in "${NODES[@]}"; do
        kill_pidfile "$ROOT/run/slurmd-$node.pid"
    done
    kill_pidfile "$ROOT/run/slurmctld.pid"
    kill_pidfile "$ROOT/munge/munged.pid"
    for node in "${NODES[@]}"; do
        ns=ml$node
        [[ -e /run/netns/$ns ]] || continue
        # anything a job left behind in the node's namespace
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            # shellcheck disable=SC2086  # one pid per word
            kill -9 $pids 2>/dev/null || true
        fi
        ip netns del "$ns" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    if grep -qF "$HOSTS_TAG" /etc/hosts 2>/dev/null; then
        # rewritten in place: /etc/hosts is often a bind mount that cannot be replaced by a rename
        local kept final_newline=$'\n'
        kept=$(grep -vF "$HOSTS_TAG" /etc/hosts || true)
        [[ -e $ROOT/hosts-lacked-final-newline ]] && final_newline=
        printf '%s%s' "$kept" "$final_newline" >/etc/hosts
    fi
    rm -rf "$ROOT"
}

down() {
    [[ $(id -u) -eq 0 ]] || die "needs root"
    down_quietly
    log "down"
}

case ${1:-} in
    up) up ;;
    down) down ;;
    *)
        echo "usage: $0 up|down" >&2
        exit 2
        ;;
esac
