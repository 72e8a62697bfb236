"""A real SLURM on emulated hosts, for the tests: munged on this machine (its socket is what every
node's munged would be), slurmctld on host 0, one slurmd per host (NodeName host<i>, NodeAddr
its address, its spool in the host's private /tmp). Debian's `slurm-wlm` and `munge`
(`launch/setup.sh --dev` installs them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "munged")


def missing() -> str | None:
    """Why a SLURM test cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    lacking = [d for d in (*DAEMONS, "tc", "nsenter") if shutil.which(d) is None]
    if lacking:
        return (f"{', '.join(lacking)} not found: `bash launch/setup.sh --dev` installs SLURM "
                "(slurm-wlm, munge) and iproute2")
    if not os.path.exists("/etc/munge/munge.key"):
        return "/etc/munge/munge.key is missing (reinstall munge)"
    return None


def _conf(cluster, shared: Path) -> str:
    nodes = "\n".join(f"NodeName=host{i} NodeAddr={a} CPUs=1 RealMemory=500 State=UNKNOWN"
                      for i, a in enumerate(cluster.addresses))
    return f"""ClusterName=tfdist
SlurmctldHost=host0({cluster.addresses[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/tmp/slurmctld
SlurmdSpoolDir=/tmp/slurmd
SlurmctldPidFile=/tmp/slurmctld.pid
SlurmdPidFile=/tmp/slurmd.pid
SlurmctldLogFile={shared}/slurmctld.log
SlurmdLogFile={shared}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
KillWait=30
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """SLURM on `cluster`'s hosts; commands run on host 0 (the login node)."""

    def __init__(self, cluster, shared: Path):
        self.cluster, self.shared = cluster, shared
        self.conf = shared / "slurm.conf"
        self.conf.write_text(_conf(cluster, shared))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60) -> None:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode:
            os.makedirs("/run/munge", exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, timeout=30)
        self.run(0, f"mkdir -p /tmp/slurmctld && slurmctld -f {self.conf}")
        for i in range(self.cluster.hosts):
            self.run(i, f"mkdir -p /tmp/slurmd && slurmd -f {self.conf} -N host{i}")
        deadline = time.monotonic() + timeout
        while True:
            states = self.run(0, "sinfo -h -o '%n %t'", check=False).stdout
            if states.count("idle") == self.cluster.hosts:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM's nodes did not come up: {states}\n"
                                   f"{(self.shared / 'slurmctld.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def run(self, host: int, script: str, check: bool = True, timeout: float = 120):
        """`script` with sh on host `host`, as root, with this cluster's SLURM_CONF."""
        done = subprocess.run(self.cluster.command(host, ["sh", "-c", script]), env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode:
            raise RuntimeError(f"`{script}` on host {host} failed: {done.stderr[-2000:]}")
        return done

    def sbatch(self, arguments: str) -> int:
        out = self.run(0, f"sbatch --parsable {arguments}").stdout.strip()
        return int(out.split(";")[0])

    def state(self, job: int) -> tuple[str, int]:
        """(state, restart count) of `job`."""
        text = self.run(0, f"scontrol show job {job}", check=False).stdout
        state = re.search(r"JobState=(\S+)", text)
        restarts = re.search(r"Restarts=(\d+)", text)
        return (state.group(1) if state else "UNKNOWN", int(restarts.group(1)) if restarts else 0)

    def logs(self, lines: int = 15) -> str:
        """The last `lines` lines of slurmctld's and every slurmd's log, for a failure message."""
        parts = []
        for log in sorted(self.shared.glob("slurm*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"\n--- {log.name} ---\n" + "\n".join(tail))
        return "".join(parts)

    def wait(self, job: int, timeout: float = 600) -> str:
        """Waits for `job` to end; returns its final state (COMPLETED, FAILED, ...)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state, _ = self.state(job)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"):
                return state
            time.sleep(1)
        raise TimeoutError(f"SLURM job {job} still {self.state(job)} after {timeout:g} s")
