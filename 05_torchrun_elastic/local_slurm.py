"""A two-node SLURM cluster on this one Linux machine, to practise sbatch, srun, squeue, scancel.

    sudo apt-get install slurm-wlm munge                 # Debian/Ubuntu; about 25 s
    sudo python3 05_torchrun_elastic/local_slurm.py up   # prints the one line to export
    export SLURM_CONF=/tmp/course-slurm/slurm.conf
    sinfo; srun -N2 hostname; sbatch 05_torchrun_elastic/train.sbatch; squeue; scancel JOBID
    sudo python3 05_torchrun_elastic/local_slurm.py down # every daemon and job process stopped
    unset SLURM_CONF

Root, Linux, no systemd needed: a munged, a slurmctld and one slurmd per node run in the
foreground of their own sessions, each with its own port, its state, logs and PID in one folder
(--state-dir). The "nodes" are names: both reach 127.0.0.1 (NodeAddr), and they share this
machine's CPUs and files, so a shared file system comes free. Jobs run as root. No cgroups:
proctrack/linuxproc follows a job's processes by parent, which is what `scancel` kills.
`down` cancels the jobs, stops the daemons by the PIDs that `up` wrote, then any job step or job
process of this cluster still running (a job step outlives slurmd otherwise), and removes the
folder. Only the standard library: it runs before any virtual environment exists.
"""
import argparse
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

DAEMONS = ["slurmctld", "slurmd", "munged", "sbatch", "scontrol"]


def free_ports(count):
    """Different ports nobody listens on now, below 32768, where the OS hands out none by itself
    with the default range (02's NOTES.md): a port from bind-to-0, closed, can go to another process
    before the daemon binds it."""
    ports = []
    while len(ports) < count:
        port = random.randint(20000, 32767)
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0 and port not in ports:
                ports.append(port)
    return ports


def refuse(message):
    print(f"local_slurm: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_machine():
    """One line, exit 2, when this machine cannot host the cluster."""
    if not sys.platform.startswith("linux"):
        refuse(f"needs Linux (this is {sys.platform}); on Windows or macOS use a Linux VM or WSL2")
    if os.geteuid() != 0:
        refuse("needs root (the daemons run as root here): run it with sudo")
    missing = [name for name in DAEMONS if not which(name)]
    if missing:
        refuse(f"{', '.join(missing)} not found: install SLURM and munge first "
               "(Debian/Ubuntu: apt-get install slurm-wlm munge)")


def which(name):
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def parents(path):
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        yield path


def pwd_or_none(user):
    try:
        return pwd.getpwnam(user)
    except KeyError:
        return None


def slurm_conf(state, nodes, cpus, ports, munge_socket):
    """The smallest configuration that runs multi-node jobs without systemd or cgroups."""
    node_lines = "\n".join(f"NodeName=node{i + 1} NodeAddr=127.0.0.1 Port={ports[1 + i]} "
                           f"CPUs={cpus} State=UNKNOWN" for i in range(nodes))
    return f"""# Written by local_slurm.py: a {nodes}-node cluster on one machine.
ClusterName=course
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={state}/slurmctld
SlurmdSpoolDir={state}/%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/%n/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# --cpus may offer more CPUs than the machine has: slurmd takes the configured counts as they are
SlurmdParameters=config_overrides
# scancel: SIGTERM, then SIGKILL after KillWait seconds
KillWait=5
MinJobAge=300
{node_lines}
PartitionName=debug Nodes=node[1-{nodes}] Default=YES MaxTime=INFINITE State=UP
"""


def start(command, log, env, state, user=None):
    """A daemon in the foreground of its own session, its PID added to the state's list at once
    (`down` stops what started, even from a start that failed half-way)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, user=user)
    with open(pids_file(state), "a") as f:
        f.write(f"{proc.pid}\n")


def pids_file(state):
    return os.path.join(state, "daemons.pid")


def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_until(predicate, seconds, what, state):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    logs = [os.path.join(root, f) for root, _, files in os.walk(state) for f in files
            if f.endswith(".log")]
    refuse(f"{what} not ready after {seconds} s; see {', '.join(sorted(logs))}")


def up(state, nodes, cpus):
    check_machine()
    if os.path.exists(pids_file(state)):
        refuse(f"a cluster already runs from {state} (or was not taken down): "
               f"run `local_slurm.py down --state-dir {state}` first")
    os.makedirs(state, exist_ok=True)
    if os.listdir(state):
        refuse(f"{state} is not empty: choose a new or empty --state-dir")
    os.chmod(state, 0o755)
    user = pwd_or_none("munge")  # munged refuses root unless forced
    blocked = [p for p in parents(state) if not os.stat(p).st_mode & 0o001]
    if blocked and user:
        refuse(f"munged runs as the user munge, who may not enter {blocked[0]}: choose a "
               "--state-dir whose every parent folder anyone may enter (under /tmp, say)")
    # munge: its own key and socket in the state folder, never the machine's /etc/munge.
    munge = os.path.join(state, "munge")
    os.makedirs(munge)
    os.chmod(munge, 0o755)  # munged: its socket's folder must be searchable by all
    with open(os.path.join(munge, "munge.key"), "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(os.path.join(munge, "munge.key"), 0o400)
    if user:
        for root, _, files in os.walk(munge):
            for name in [root] + [os.path.join(root, f) for f in files]:
                os.chown(name, user.pw_uid, user.pw_gid)
    as_user, force = ("munge", []) if user else (None, ["--force"])
    munge_socket = os.path.join(munge, "munge.socket")
    ports = free_ports(nodes + 1)
    conf = os.path.join(state, "slurm.conf")
    with open(conf, "w") as f:
        f.write(slurm_conf(state, nodes, cpus, ports, munge_socket))
    for i in range(nodes):
        os.makedirs(os.path.join(state, f"node{i + 1}"))
    env = dict(os.environ, SLURM_CONF=conf)

    def all_idle():
        out = subprocess.run([which("sinfo"), "-h", "-N", "-o", "%N %T"], env=env,
                             capture_output=True, text=True).stdout.split()
        return out[1::2] == ["idle"] * nodes

    try:
        start([which("munged"), "--foreground", *force, f"--socket={munge_socket}",
               f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid",
               f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"],
              os.path.join(munge, "stdout.log"), env, state, as_user)
        wait_until(lambda: os.path.exists(munge_socket), 15, "munged", state)
        start([which("slurmctld"), "-D", "-c", "-i"], os.path.join(state, "slurmctld.stdout.log"),
              env, state)
        for i in range(nodes):
            start([which("slurmd"), "-D", "-N", f"node{i + 1}"],
                  os.path.join(state, f"node{i + 1}", "stdout.log"), env, state)
        wait_until(all_idle, 30, f"{nodes} idle nodes", state)
    except BaseException:  # nothing left running from a failed start
        down(state, quiet=True, keep_logs=True)
        raise
    print(f"local_slurm: {nodes} nodes x {cpus} CPUs up (state in {state}); now run:")
    print(f"export SLURM_CONF={conf}")


def job_processes(conf):
    """This cluster's job steps: slurmstepd, and the processes of its jobs (SLURM_JOB_ID), each
    with this cluster's SLURM_CONF. A learner's shell that exported SLURM_CONF is neither."""
    found, variable = [], f"SLURM_CONF={conf}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{pid}/comm") as f:
                stepd = f.read().startswith("slurmstepd")
        except OSError:
            continue
        if variable in environ and (stepd or any(v.startswith(b"SLURM_JOB_ID=") for v in environ)):
            found.append(int(pid))
    return found


def stop(pids, seconds=10):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + seconds
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in filter(running, pids):
        os.kill(pid, signal.SIGKILL)


def down(state, quiet=False, keep_logs=False):
    check_machine()
    if not os.path.exists(pids_file(state)):
        refuse(f"no cluster was started from {state} (no {pids_file(state)})")
    conf = os.path.join(state, "slurm.conf")
    env = dict(os.environ, SLURM_CONF=conf)
    with open(pids_file(state)) as f:
        daemons = [int(line) for line in f if line.strip()]
    if len(daemons) > 1 and running(daemons[1]):  # slurmctld: cancel the jobs while it can
        subprocess.run([which("scancel"), "--full", "--user=root"], env=env, capture_output=True,
                       timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and subprocess.run(
                [which("squeue"), "-h"], env=env, capture_output=True, text=True).stdout.strip():
            time.sleep(0.2)
    stop(daemons[1:][::-1])  # the slurmds, then slurmctld
    stop(job_processes(conf))  # job steps that outlived slurmd
    stop(daemons[:1])  # munged last: slurm needs it until the end
    if keep_logs:  # a failed start: the logs say why
        os.remove(pids_file(state))
    else:
        shutil.rmtree(state)
    if not quiet:
        print(f"local_slurm: stopped {len(daemons)} daemons; removed {state}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--state-dir", default="/tmp/course-slurm",
                        help="the cluster's folder: config, logs, PIDs (default /tmp/course-slurm)")
    parser.add_argument("--nodes", type=int, default=2, help="how many nodes (default 2)")
    parser.add_argument("--cpus", type=int, default=os.cpu_count(),
                        help="CPUs each node offers (default: this machine's, "
                             f"{os.cpu_count()}); the nodes share them")
    args = parser.parse_args(argv)
    if not 1 <= args.nodes <= 16 or args.cpus < 1:
        refuse("--nodes must be 1 to 16 and --cpus at least 1")
    state = os.path.abspath(args.state_dir)
    up(state, args.nodes, args.cpus) if args.action == "up" else down(state)


if __name__ == "__main__":
    main()
