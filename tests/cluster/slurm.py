"""A real SLURM cluster on one machine: ``slurmctld`` and one ``slurmd`` per host of the
multi-host test bed (:mod:`multihost.netns`: each host a network namespace with an address
in 127.200.0.0/24), authenticated by ``munged``, all from Debian's ``slurm-wlm`` and
``munge`` packages and all started and removed by :class:`SlurmCluster` itself.

Each ``slurmd`` runs in its host's network namespace, under that host's name as hostname
(a UTS namespace of its own), so jobs, job steps and the MPI daemons ``srun`` starts for
Open MPI run there, as on separate machines. Host names resolve through a hosts file of
the bed's, mounted over ``/etc/hosts`` in a mount namespace of each host's own, so nothing
outside the bed sees them. (``nsenter``, not ``ip netns exec``: the latter mounts a fresh
``/sys`` without the cgroup file systems slurmd needs.) The controller runs on the first host,
which is also where the tests submit from (the login node). Everything a daemon writes
(configuration, state, spool, logs, the munge key and socket) lives in the bed's own
directory.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multihost"))
from netns import SetupRefused, Testbed  # noqa: E402

# Debian's packages: slurm-wlm brings the daemons and the client commands, munge the authentication.
PROGRAMS = ("nsenter", "slurmctld", "slurmd", "slurmstepd", "sbatch", "salloc", "srun", "scancel", "squeue", "scontrol",
            "sinfo", "munged", "mungekey")
# Run a command on a host: its hostname, the bed's hosts file as /etc/hosts, and the host's
# own directory as SLURM's TmpFS (PMIx keeps a job step's files there, under names that
# would collide between hosts sharing one).
_ON_HOST = ('hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" "$4" && shift 4 && exec "$@"')
_READY_S = 30.0


def skip_reason() -> str | None:
    """Why this machine cannot hold the SLURM bed, or None."""
    missing = [name for name in PROGRAMS if shutil.which(name) is None
               and not Path("/usr/sbin", name).exists()]
    if missing:
        return f"SLURM or munge is not installed (no {', '.join(missing)}; Debian: apt-get install slurm-wlm munge)"
    return None


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """``count`` SLURM nodes, one per test-bed host, each with ``cpus`` CPUs; call
    :meth:`destroy` when done (also after a failed :meth:`build`)."""

    def __init__(self, prefix: str, count: int, workdir: Path, cpus: int = 2) -> None:
        self.bed = Testbed(prefix, count, workdir)
        self.workdir = workdir
        self.cpus = cpus
        self.conf = workdir / "slurm.conf"
        self.nodes = [host.namespace for host in self.bed.hosts]
        self.hosts_file = workdir / "hosts"
        self.node_tmp = workdir / "node-tmp"  # each host's own directory is mounted here
        self._daemons: list[subprocess.Popen[bytes]] = []

    # --- building and tearing down ------------------------------------------------------

    def build(self) -> None:
        self.bed.build()
        self.node_tmp.mkdir(exist_ok=True)
        self._write_hosts_files()
        self._start_munge()
        self._write_config()
        head = self.bed.hosts[0]
        self._daemon(head.namespace, _program("slurmctld"), "-D", "-i", "-f", str(self.conf))
        for host in self.bed.hosts:
            (self.workdir / "spool" / host.namespace).mkdir(parents=True, exist_ok=True)
            self._daemon(host.namespace, _program("slurmd"), "-D", "-N", host.namespace, "-f", str(self.conf))
        self._wait_until_idle()

    def destroy(self) -> list[str]:
        """Stop every daemon, remove the namespaces and hosts files; returns leftover namespaces."""
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in self._daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        self._daemons = []
        return self.bed.destroy()

    def _write_hosts_files(self) -> None:
        self.hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{h.address} {h.namespace}\n"
                                                                     for h in self.bed.hosts))

    def _start_munge(self) -> None:
        key, socket = self.workdir / "munge.key", self.workdir / "munge.socket"
        _checked([_program("mungekey"), "--create", "--keyfile", str(key)])
        os.chmod(key, 0o600)
        self._daemons.append(subprocess.Popen(
            [_program("munged"), "--foreground", "--force", f"--socket={socket}", f"--key-file={key}",
             f"--pid-file={self.workdir / 'munged.pid'}", f"--seed-file={self.workdir / 'munged.seed'}",
             f"--log-file={self.workdir / 'munged.log'}"],
            stdout=subprocess.DEVNULL, stderr=open(self.workdir / "munged.err", "wb")))
        deadline = time.monotonic() + _READY_S
        while not socket.exists():
            if self._daemons[-1].poll() is not None or time.monotonic() > deadline:
                raise SetupRefused(f"munged did not start: {(self.workdir / 'munged.err').read_text()}")
            time.sleep(0.05)

    def _write_config(self) -> None:
        head = self.bed.hosts[0]
        state = self.workdir / "state"
        state.mkdir(exist_ok=True)
        nodes = "".join(f"NodeName={h.namespace} NodeAddr={h.address} CPUs={self.cpus} State=UNKNOWN\n"
                        for h in self.bed.hosts)
        self.conf.write_text(f"""\
ClusterName=psrt
SlurmctldHost={head.namespace}({head.address})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.workdir / 'munge.socket'}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}
TmpFS={self.node_tmp}
SlurmdSpoolDir={self.workdir / 'spool'}/%n
SlurmctldPidFile={self.workdir}/slurmctld.pid
SlurmdPidFile={self.workdir}/slurmd-%n.pid
SlurmctldLogFile={self.workdir}/slurmctld.log
SlurmdLogFile={self.workdir}/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=10
InactiveLimit=0
KillWait=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}PartitionName=bed Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _daemon(self, namespace: str, *argv: str) -> None:
        """Start a daemon in ``namespace`` with that host's name, in the foreground (ours to end)."""
        name = Path(argv[0]).name
        log = open(self.workdir / f"{name}-{namespace}.out", "wb")
        self._daemons.append(subprocess.Popen(self.on_host(namespace, *argv), stdout=log, stderr=subprocess.STDOUT,
                                              env=self.environment()))

    def _wait_until_idle(self) -> None:
        deadline = time.monotonic() + _READY_S
        states = ""
        while time.monotonic() < deadline:
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise SetupRefused(f"a SLURM daemon exited at start-up ({' '.join(map(str, daemon.args[-6:]))}):"
                                       f"\n{self.logs()}")
            done = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False)
            states = done.stdout
            found = dict(line.split() for line in states.splitlines() if line.strip())
            if len(found) == len(self.nodes) and all(state == "idle" for state in found.values()):
                return
            time.sleep(0.3)
        raise SetupRefused(f"the SLURM nodes did not become idle within {_READY_S:g} s: {states!r}\n{self.logs()}")

    # --- using it ----------------------------------------------------------------------

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a command on the login node: SLURM_CONF, without another job's SLURM_ variables."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def on_host(self, namespace: str, *argv: str) -> list[str]:
        """``argv`` as run on the host whose namespace is ``namespace``."""
        own_tmp = self.workdir / "tmp" / namespace
        own_tmp.mkdir(parents=True, exist_ok=True)
        return ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts", "--mount", "sh", "-c", _ON_HOST,
                "on-host", namespace, str(self.hosts_file), str(own_tmp), str(self.node_tmp), *argv]

    def command(self, *argv: str) -> list[str]:
        """``argv`` as run on the login node (the first host)."""
        return self.on_host(self.bed.hosts[0].namespace, *argv)

    def run(self, *argv: str, env: Mapping[str, str] | None = None, check: bool = True,
            timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self.command(*argv), capture_output=True, text=True, timeout=timeout_s,
                              env=self.environment(env), check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr}{done.stdout}")
        return done

    def job_state(self, job_id: str) -> str:
        """The state SLURM gives job ``job_id`` (``RUNNING``, ``COMPLETED``, ``CANCELLED``, ...)."""
        done = self.run("scontrol", "show", "job", job_id, check=False)
        found = re.search(r"JobState=(\S+)", done.stdout)
        return found.group(1) if found else "UNKNOWN"

    def wait_for_job(self, job_id: str, timeout_s: float) -> str:
        """Wait until job ``job_id`` has ended; returns its final state."""
        return self.wait_for_state(job_id, ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT",
                                            "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"), timeout_s)

    def wait_for_state(self, job_id: str, states: Sequence[str], timeout_s: float) -> str:
        """Wait until job ``job_id`` is in one of ``states``; returns it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} still {self.job_state(job_id)} after {timeout_s:g} s\n{self.logs()}")

    def pids_on(self, namespace: str) -> list[int]:
        """The processes running on the host of ``namespace``."""
        listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=20,
                                check=False).stdout
        return [int(pid) for pid in listed.split()]

    def kill_node(self, index: int) -> None:
        """A node fails: every process on it (its slurmd, job steps, ranks) dies at once."""
        Testbed._end_processes_in(self.bed.hosts[index].namespace)

    def revive_node(self, index: int, wait: bool = True) -> None:
        """Bring a killed node back: its slurmd again (and, with ``wait``, until SLURM has
        every node idle)."""
        host = self.bed.hosts[index]
        self._daemons = [d for d in self._daemons if d.poll() is None]
        self._daemon(host.namespace, _program("slurmd"), "-D", "-N", host.namespace, "-f", str(self.conf))
        if wait:
            self._wait_until_idle()

    def logs(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.workdir.glob("*.log")) + sorted(self.workdir.glob("*.out")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name} ---\n" + "\n".join(tail))
        return "\n".join(out)


def _checked(argv: Sequence[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise SetupRefused(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
