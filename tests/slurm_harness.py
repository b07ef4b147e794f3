"""A real SLURM on this machine for the tests: munged, slurmctld and two slurmd as nodes n1 and n2.

Each slurmd runs in its own network namespace (veth + bridge, a private 10.x/24 that exists only
inside this machine), so the two nodes have distinct addresses and TF workers on them do not
collide on ports, and in its own mount namespace, where a bind-mounted /etc/hosts names the nodes.
Jobs, steps and their tasks inherit both namespaces from their slurmd. Namespaces are entered with
`nsenter --net=/run/netns/NAME` (`ip netns exec` fails here: "No filesystem mounted on
/sys/fs/cgroup"). Every daemon is started in the foreground and stopped by its PID.

Usage (the `slurm` fixture in tests/test_slurm_jobs.py does this):
    with SlurmHarness(tmp_dir) as slurm:
        job = slurm.sbatch(["--nodes=2", "script.sh"], cwd=submit_dir)
        state = slurm.wait(job)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NODES = ("n1", "n2")
APT_PACKAGES = ("slurm-wlm", "munge")  # also in the Makefile's APT_PACKAGES
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun", "nsenter", "unshare", "ip")


def unavailable_reason() -> str | None:
    """Why the harness cannot run here (None when it can); installs Debian's SLURM when root."""
    if os.geteuid() != 0:
        return "needs root: starts munged, slurmctld, slurmd and creates network namespaces"
    missing = [tool for tool in DAEMONS if not shutil.which(tool)]
    if missing:
        proc = subprocess.run(
            ["bash", "-c", "apt-get update -qq -o DPkg::Lock::Timeout=600 && DEBIAN_FRONTEND=noninteractive "
             f"apt-get install -y -qq -o DPkg::Lock::Timeout=600 {' '.join(APT_PACKAGES)}"],
            capture_output=True, text=True, timeout=900)
        missing = [tool for tool in DAEMONS if not shutil.which(tool)]
        if missing:
            return f"SLURM tools missing after apt-get install ({missing}): {proc.stderr[-500:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


class SlurmHarness:
    """A two-node SLURM cluster on this machine (see module docstring). Root only."""

    def __init__(self, workdir: str | os.PathLike, cpus_per_node: int = 2):
        self.dir = Path(workdir).resolve()
        self.cpus = cpus_per_node
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"tfdbr{tag}"
        self.netns = {n: f"tfd{tag}{n}" for n in NODES}
        self.veth = {n: f"tfdv{tag}{n}" for n in NODES}
        self.subnet = self._pick_subnet()
        self.ctl_addr = f"{self.subnet}.1"
        self.addrs = {n: f"{self.subnet}.{11 + i}" for i, n in enumerate(NODES)}
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: dict[str, subprocess.Popen] = {}
        self._links: list[str] = []

    # --- life cycle -------------------------------------------------------------------------------
    def __enter__(self) -> "SlurmHarness":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)
        for sub in ("state", "munge", *(f"spool/{n}" for n in NODES), *(f"tmp/{n}" for n in NODES)):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir / "munge", 0o700)
        self._network()
        self._munge()
        self._write_conf()
        self._start("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)])
        self._wait_for(lambda: _run_ok(["scontrol", "ping"], self.env), 20, "slurmctld to answer scontrol ping")
        hosts = self.dir / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.addrs.items())
                         + f"{self.ctl_addr} slurmctl\n")
        for node in NODES:
            # Own network namespace (distinct address), own mount namespace (its /etc/hosts).
            script = f"mount --bind {hosts} /etc/hosts && exec slurmd -D -f {self.conf} -N {node}"
            self._start(f"slurmd-{node}", ["nsenter", f"--net=/run/netns/{self.netns[node]}", "unshare", "--mount",
                                           "--propagation", "private", "sh", "-c", script])
        self._wait_for(self._nodes_idle, 30, "both nodes idle in sinfo")

    def stop(self) -> None:
        """Cancels jobs, stops every daemon by PID, removes the namespaces. Safe to call twice."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
            time.sleep(0.5)
        for name in [n for n in self._procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._kill_leftover_steps()
        for link in self._links:
            _sh("ip", "link", "del", link, check=False)
        self._links.clear()
        for ns in self.netns.values():
            if Path(f"/run/netns/{ns}").exists():
                _sh("ip", "netns", "del", ns, check=False)

    # --- jobs ---------------------------------------------------------------------------------
    def sbatch(self, args: list[str], cwd: str | os.PathLike, env: dict | None = None) -> str:
        """Submits a batch job (`sbatch --parsable ARGS`) from `cwd` and returns its id."""
        proc = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=30)
        if proc.returncode:
            raise RuntimeError(f"sbatch {args} failed: {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); {} once the job is gone."""
        proc = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=self.env, capture_output=True,
                              text=True, timeout=30)
        info = {}
        for field in proc.stdout.split():
            key, _, value = field.partition("=")
            info.setdefault(key, value)
        return info

    def wait(self, job_id: str, timeout: float = 180, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                             "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")) -> str:
        """Polls the job until its state is in `until`; returns the state (raises on timeout)."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_info(job_id).get("JobState", "")
            if state in until:
                return state
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} still {state!r} after {timeout} s; slurmctld log tail:\n{self.log_tail()}")

    def wait_requeued(self, job_id: str, timeout: float = 120) -> dict[str, str]:
        """Waits until the job is back in the queue after a requeue (Restarts >= 1, PENDING)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") == "PENDING" and int(info.get("Restarts", "0") or 0) >= 1:
                return info
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
                raise RuntimeError(f"job {job_id} ended ({info.get('JobState')}) instead of being requeued")
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} was not requeued within {timeout} s:\n{self.log_tail()}")

    def start_requeued_now(self, job_id: str, timeout: float = 120) -> dict[str, str]:
        """Waits for the requeue, then lets the job start at once instead of after SLURM's requeue delay
        (BeginTime = requeue time + ~2 min, hard-coded in slurmctld; seen here: 150 s).

        Not within the second of the kill: slurmd revokes the killed run's credential with a
        whole-second timestamp and refuses a credential of the same job created in that second
        ("Killing non-startable batch JobId=N: Job credential revoked"; seen once in CI).
        """
        info = self.wait_requeued(job_id, timeout)
        time.sleep(2.0)
        self.scontrol("update", f"JobId={job_id}", "StartTime=now")
        return info

    def scancel_signal(self, job_id: str, sig: str) -> None:
        """Sends `sig` to the job's steps, as `sbatch --signal=SIG@T` does before the time limit."""
        _sh_env(["scancel", f"--signal={sig}", job_id], self.env)

    def scontrol(self, *args: str) -> str:
        proc = _sh_env(["scontrol", *args], self.env)
        return proc.stdout

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for log in sorted(self.dir.glob("*.log")):
            out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    # --- internals ----------------------------------------------------------------------------
    def _pick_subnet(self) -> str:
        used = _sh("ip", "-4", "addr").stdout
        for k in range(os.getpid() % 200, os.getpid() % 200 + 200):
            subnet = f"10.213.{k % 250}"
            if f"{subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.213.x.0/24 subnet")

    def _network(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        _sh("ip", "addr", "add", f"{self.ctl_addr}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for node in NODES:
            ns, veth, peer = self.netns[node], self.veth[node], self.veth[node] + "p"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            self._links.append(veth)
            _sh("ip", "link", "set", peer, "netns", ns)
            _sh("ip", "link", "set", veth, "master", self.bridge, "up")
            inside = ["nsenter", f"--net=/run/netns/{ns}", "ip"]
            _sh(*inside, "addr", "add", f"{self.addrs[node]}/24", "dev", peer)
            _sh(*inside, "link", "set", peer, "up")
            _sh(*inside, "link", "set", "lo", "up")

    def _munge(self) -> None:
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        self.munge_socket = self.dir / "munge" / "munge.socket"
        self._start("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={self.dir / 'munge' / 'munged.pid'}",
                               f"--log-file={self.dir / 'munged.log'}", f"--seed-file={self.dir / 'munge' / 'seed'}"])
        self._wait_for(self.munge_socket.exists, 10, "munged socket")

    def _write_conf(self) -> None:
        d = self.dir
        self.ctld_port = _free_port()
        nodes = "".join(f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN\n"
                        for n, a in self.addrs.items())
        self.conf.write_text(f"""\
# Generated by tests/slurm_harness.py: two nodes in their own network namespaces on one machine.
ClusterName=tfdist
SlurmctldHost=localhost({self.ctl_addr})
SlurmctldPort={self.ctld_port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
TmpFS={d}/tmp/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
JobRequeue=1
KillWait=5
MinJobAge=600
{nodes}PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "wb")
        self._procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                             start_new_session=True)
        log.close()

    def _nodes_idle(self) -> bool:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n"
                                       f"{(self.dir / (name + '.out')).read_text(errors='replace')[-2000:]}\n"
                                       f"{self.log_tail()}")
            if ready():
                return
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout} s waiting for {what}:\n{self.log_tail()}")

    def _kill_leftover_steps(self) -> None:
        # slurmstepd and job processes run in the node namespaces; a step hung in PMIx can outlive its
        # slurmd. Find them by their network namespace and kill them by PID.
        for ns in self.netns.values():
            path = Path(f"/run/netns/{ns}")
            if not path.exists():
                continue
            ns_ino = path.stat().st_ino
            for pid_dir in Path("/proc").iterdir():
                if not pid_dir.name.isdigit():
                    continue
                try:
                    if os.stat(pid_dir / "ns" / "net").st_ino == ns_ino:
                        os.kill(int(pid_dir.name), signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    pass


def _run_ok(cmd: list[str], env: dict) -> bool:
    return subprocess.run(cmd, env=env, capture_output=True, timeout=10).returncode == 0


def _sh_env(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc
