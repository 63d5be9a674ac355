#!/usr/bin/env bash
# A throwaway SLURM cluster on this machine, from Debian's own packages (Debian 12 "bookworm", Slurm 22.05, root,
# no systemd), for the `slurm` tests and for trying `python -m tools.slurm submit` without a real cluster.
#   bash tools/slurm_cluster.sh install   # apt-get slurmctld slurmd slurm-client (munge comes as a dependency); idempotent
#   bash tools/slurm_cluster.sh start     # write slurm.conf, start the daemons, wait until every node is idle
#   bash tools/slurm_cluster.sh smoke     # sbatch a 2-task `srun` job and check both tasks ran
#   bash tools/slurm_cluster.sh stop      # stop exactly the daemons `start` started (by PID)
#   bash tools/slurm_cluster.sh env       # prints `export SLURM_CONF=...` for sbatch/squeue/scontrol
# Adapted from ../shared/tools/slurm-ci.sh (see the project notes on SLURM for why each setting is there).
# Env knobs:
#   SLURM_CI_DIR   state/log/conf folder               (default /tmp/dptrain-slurm)
#   SLURM_CI_NODES 1 = one node "localhost"; 2 (default) = two slurmd's n1,n2 on this host (multiple-slurmd), so a
#                  2-node job runs here. Their names do not resolve: jobs need MASTER_ADDR=127.0.0.1 (the app's
#                  preflight says so when it is missing).
#   SLURM_CI_AUTH  none (default, no munged needed) | munge
#   SLURM_CI_CPUS  CPUs advertised per node            (default 4; more than nproc works thanks to config_overrides)
# The daemons' ports (slurmctld, each slurmd) are free ones chosen at each start, not Slurm's fixed 6817/6818: those
# clash with another cluster on the machine (another checkout's tests, a real Slurm). `env` gives SLURM_CONF, which
# holds them.
set -euo pipefail
D=${SLURM_CI_DIR:-/tmp/dptrain-slurm}
NODES=${SLURM_CI_NODES:-2}
AUTH=${SLURM_CI_AUTH:-none}
CPUS=${SLURM_CI_CPUS:-4}
export SLURM_CONF=$D/slurm.conf

log() { echo "[slurm_cluster] $*" >&2; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
    log "slurm already installed: $(slurmd -V)"; return 0
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
  log "installed $(slurmd -V)"
}

node_names() { if [ "$NODES" = 1 ]; then echo localhost; else seq -f 'n%g' 1 "$NODES"; fi; }

# free_ports N: N distinct TCP ports nothing listens on, at random below the kernel's ephemeral range (a port there
# can be handed out to an outgoing connection at any time)
free_ports() {
  python3 - "$1" <<'PY'
import random, socket, sys
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
ports = set()
while len(ports) < int(sys.argv[1]):
    port = random.randrange(20000, low)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    ports.add(port)
print(" ".join(map(str, ports)))
PY
}

write_conf() {
  # a fresh cluster each start: state recovered from an earlier one can hold a node in "completing" for minutes
  rm -rf "$D/state" "$D/spool"
  mkdir -p "$D"/{state,spool,log,run}
  local cred=none; [ "$AUTH" = munge ] && cred=munge
  local ports; read -r -a ports <<< "$(free_ports $((NODES + 2)))"  # slurmctld, slurmd (one node), one per node
  cat > "$SLURM_CONF" <<EOF
ClusterName=ci
SlurmctldHost=localhost(127.0.0.1)
AuthType=auth/$AUTH
CredType=cred/$cred
AuthInfo=cred_expire=5
CommunicationParameters=NoInAddrAny
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${ports[0]}
SlurmdPort=${ports[1]}
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=600
KillWait=5
Waittime=0
EOF
  local i=2 n
  for n in $(node_names); do
    if [ "$NODES" = 1 ]; then
      echo "NodeName=$n NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=1000 State=UNKNOWN" >> "$SLURM_CONF"
    else
      echo "NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=${ports[$i]} CPUs=$CPUS RealMemory=1000 State=UNKNOWN" >> "$SLURM_CONF"
    fi
    i=$((i + 1))
    mkdir -p "$D/spool/$n"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$SLURM_CONF"
}

running() { [ -f "$D/run/slurmctld.fg.pid" ] && kill -0 "$(cat "$D/run/slurmctld.fg.pid")" 2>/dev/null; }

start() {
  local t0 attempt; t0=$(date +%s.%N)
  if running; then log "already running (SLURM_CONF=$SLURM_CONF)"; sinfo >&2; return 0; fi
  command -v slurmctld >/dev/null || { log "slurm is not installed: run '$0 install' first (as root)"; return 1; }
  for attempt in 1 2 3; do  # again with other ports if one was taken between choosing and binding it
    write_conf
    launch_daemons
    for _ in $(seq 150); do   # up to 30 s
      if [ "$(sinfo -h -o '%T %D' 2>/dev/null)" = "idle $NODES" ]; then
        log "cluster up in $(python3 -c "import sys; print(round($(date +%s.%N) - $t0, 2))") s; export SLURM_CONF=$SLURM_CONF"
        sinfo >&2; return 0
      fi
      if grep -qi "address already in use" "$D"/log/*.out "$D"/log/*.log 2>/dev/null; then break; fi
      sleep 0.2
    done
    grep -qi "address already in use" "$D"/log/*.out "$D"/log/*.log 2>/dev/null || break
    log "a port was taken meanwhile (attempt $attempt); starting again with other ports"
    stop; rm -f "$D"/log/*
  done
  log "cluster did not come up"; sinfo >&2 || true; tail -n 30 "$D"/log/*.out >&2 || true; return 1
}

launch_daemons() {
  if [ "$AUTH" = munge ]; then
    mkdir -p /run/munge && chown munge:munge /run/munge
    [ -s /etc/munge/munge.key ] || { mungekey --create --force && chown munge:munge /etc/munge/munge.key; }
    setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground \
      > "$D/log/munged.out" 2>&1 &
    echo $! > "$D/run/munged.fg.pid"
    for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  slurmctld -D -f "$SLURM_CONF" > "$D/log/slurmctld.out" 2>&1 &
  echo $! > "$D/run/slurmctld.fg.pid"
  local n
  for n in $(node_names); do
    slurmd -D -N "$n" -f "$SLURM_CONF" > "$D/log/slurmd-$n.out" 2>&1 &
    echo $! > "$D/run/slurmd-$n.fg.pid"
  done
}

stop() {
  local f pid _
  if running; then  # cancel what still runs first: job steps outlive slurmd otherwise
    squeue -h -o %i 2>/dev/null | xargs -r scancel --full 2>/dev/null || true
    for _ in $(seq 75); do squeue -h 2>/dev/null | grep -q . || break; sleep 0.2; done
  fi
  for f in "$D"/run/slurmd-*.fg.pid "$D/run/slurmctld.fg.pid" "$D/run/munged.fg.pid"; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { log "pid $pid ignored SIGTERM, SIGKILL"; kill -9 "$pid" || true; }
    wait "$pid" 2>/dev/null || true
    rm -f "$f"
  done
  log "stopped"
}

# wait_job JOBID [TIMEOUT_S]: wait until the job leaves the queue; print its final state
wait_job() {
  local j=$1 limit=${2:-120} t=0
  while squeue -h -j "$j" 2>/dev/null | grep -q .; do
    sleep 0.2; t=$((t + 1)); [ $t -lt $((limit * 5)) ] || { log "job $j timed out"; scancel "$j"; return 1; }
  done
  scontrol show job "$j" | grep -oE 'JobState=[A-Z_]+' | cut -d= -f2
}

smoke() {
  local out j st
  out=$(mktemp -p "$D" smoke.XXXX)
  j=$(sbatch --parsable --time=2 --nodes="$NODES" --ntasks-per-node=$((2 / NODES)) -o "$out" \
        --wrap 'srun bash -c "echo \$SLURM_PROCID/\$SLURM_NTASKS local=\$SLURM_LOCALID node=\$SLURM_NODEID"')
  st=$(wait_job "$j" 60)
  cat "$out"
  [ "$st" = COMPLETED ] && [ "$(grep -c '/2 local=' "$out")" = 2 ]
}

show_env() { echo "export SLURM_CONF=$SLURM_CONF"; }

case "${1:-}" in
  install|start|stop|smoke|wait_job) "$@" ;;
  env) show_env ;;
  *) echo "usage: $0 install|start|stop|smoke|env|wait_job JOBID [TIMEOUT_S]" >&2; exit 2 ;;
esac
