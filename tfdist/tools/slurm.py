"""Tasks of a SLURM job step as TF_CONFIG workers (and parameter servers).

`srun python -m tfdist.launch --slurm -- tfdist train ...` runs on every task of the step: it
reads SLURM's environment (`slurm_cluster`: this task's rank and every task's address), writes
the TF_CONFIG of this task and replaces itself with the command, so the task *is* the worker
(a signal SLURM sends to the step reaches it directly).

* Tasks: SLURM_PROCID of SLURM_NTASKS, placed block by block on the step's nodes
  (SLURM_STEP_NODELIST expanded with `scontrol show hostnames`, SLURM_STEP_TASKS_PER_NODE);
  `--distribution=block`, SLURM's default, is required and checked (each task finds itself
  where the plan puts it: on SLURMD_NODENAME, at SLURM_LOCALID).
* Addresses: node:port, node:port+1, ... for the tasks of a node. The port is `port` when given,
  else one derived from the job and step ids and the restart count (20000-39999), so two jobs,
  two steps of one job, or a requeued job and its previous run, on the same nodes rarely meet;
  pass `--port` where a site reserves ports.
* `ps`: the first P tasks are parameter servers, the others workers.
* Threads: with `--cpus-per-task N` (SLURM_CPUS_PER_TASK), TensorFlow's intra-op threads are N
  (`task_threads`), unless TF_NUM_INTRAOP_THREADS is set; without it TensorFlow sizes its pool
  to the cores the task may run on (every core of the node when SLURM does not bind tasks).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping

PORT_SPAN = (20000, 20000)  # derived ports: first, count


def expand_nodelist(nodelist: str, scontrol: str = "scontrol") -> list[str]:
    """'node[01-02],gpu7' -> ['node01', 'node02', 'gpu7'], as SLURM expands it."""
    out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                         text=True, timeout=60)
    if out.returncode:
        raise ValueError(f"`{scontrol} show hostnames {nodelist}` failed: "
                         f"{out.stderr.strip() or out.returncode}")
    return out.stdout.split()


def tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed counts, '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for item in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={text!r} is not SLURM's 'N(xM),...'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def derived_port(environ: Mapping[str, str]) -> int:
    """The first port of a step: from the job and step ids and the job's restart count (a
    requeued job's new tasks may start while the old ones still hold their ports), in
    [20000, 40000)."""
    job = int(environ.get("SLURM_JOB_ID", "0") or 0)
    step = int(environ.get("SLURM_STEP_ID", "0") or 0)
    restart = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
    first, count = PORT_SPAN
    return first + (job * 97 + step * 31 + restart * 7919) % (count - 64)


def slurm_cluster(environ: Mapping[str, str] | None = None, ps: int = 0,
                  port: int | None = None, scontrol: str = "scontrol") -> tuple[int, list[str]]:
    """(this task's rank, every task's "host:port" in rank order) of a SLURM step (see the
    module docstring).

    Raises:
        ValueError: not inside a SLURM step, a layout that is not block by block, or too few
            tasks for `ps`; the message says what to change.
    """
    environ = os.environ if environ is None else environ
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID") if k not in environ]
    if missing:
        raise ValueError(f"--slurm: {', '.join(missing)} not set: run it as a task of a job step, "
                         "`srun python -m tfdist.launch --slurm -- ...` inside an allocation "
                         "(sbatch or salloc)")
    rank, ntasks = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    counts_text = (environ.get("SLURM_STEP_TASKS_PER_NODE")
                   or environ.get("SLURM_TASKS_PER_NODE"))
    if not nodelist or not counts_text:
        raise ValueError("--slurm: SLURM_STEP_NODELIST / SLURM_STEP_TASKS_PER_NODE not set: run "
                         "it under srun")
    nodes, counts = expand_nodelist(nodelist, scontrol), tasks_per_node(counts_text)
    if len(nodes) != len(counts) or sum(counts) != ntasks:
        raise ValueError(f"--slurm: {len(nodes)} nodes ({nodelist}) with tasks {counts} do not "
                         f"add up to SLURM_NTASKS={ntasks}")
    if not 0 <= ps < ntasks:
        raise ValueError(f"--ps {ps} leaves no task of the {ntasks} to train: ask SLURM for more "
                         "tasks (-n) or fewer parameter servers")
    base = derived_port(environ) if port is None else port
    addresses, placed = [], []
    for node, count in zip(nodes, counts):
        for local in range(count):
            addresses.append(f"{node}:{base + local}")
            placed.append((node, local))
    here, local = environ.get("SLURMD_NODENAME"), int(environ["SLURM_LOCALID"])
    if here is not None and placed[rank] != (here, local):
        raise ValueError(f"--slurm: task {rank} runs on {here} as local task {local}, but a block "
                         f"layout puts it on {placed[rank][0]} as {placed[rank][1]}: run srun "
                         "with --distribution=block (SLURM's default)")
    return rank, addresses


def task_threads(environ: Mapping[str, str]) -> dict[str, str]:
    """{TF_NUM_INTRAOP_THREADS: SLURM_CPUS_PER_TASK} for a task given its cores by SLURM, or {}
    (none given, or TF_NUM_INTRAOP_THREADS already set)."""
    cpus = environ.get("SLURM_CPUS_PER_TASK", "")
    if "TF_NUM_INTRAOP_THREADS" in environ or not cpus.isdigit() or int(cpus) < 1:
        return {}
    return {"TF_NUM_INTRAOP_THREADS": cpus}


def horovod_slots(addresses: list[str]) -> list[dict[str, int | str]]:
    """Horovod's view of the tasks at `addresses` ("node:port", rank order, block by block):
    per rank its node and its rank, local rank and cross rank with their sizes, as horovodrun
    computes them (`HOROVOD_*` variables of a Gloo job)."""
    nodes = [a.rsplit(":", 1)[0] for a in addresses]
    order = list(dict.fromkeys(nodes))
    slots: list[dict[str, int | str]] = []
    for rank, node in enumerate(nodes):
        local_rank = nodes[:rank].count(node)
        peers = [n for n in order if nodes.count(n) > local_rank]  # nodes with that local rank
        slots.append({"hostname": node, "rank": rank, "size": len(nodes),
                      "local_rank": local_rank, "local_size": nodes.count(node),
                      "cross_rank": peers.index(node), "cross_size": len(peers)})
    return slots


RENDEZVOUS_OFFSET = 500  # the rendezvous port: the step's first port + this


def horovod_environment(rank: int, addresses: list[str]) -> dict[str, str]:
    """The environment that makes task `rank` a Horovod rank of a Gloo job whose rendezvous
    server (`serve_rendezvous`) runs on task 0's node; no horovodrun."""
    slot = horovod_slots(addresses)[rank]
    node0, port0 = addresses[0].rsplit(":", 1)
    return {"HOROVOD_HOSTNAME": str(slot["hostname"]), "HOROVOD_RANK": str(slot["rank"]),
            "HOROVOD_SIZE": str(slot["size"]), "HOROVOD_LOCAL_RANK": str(slot["local_rank"]),
            "HOROVOD_LOCAL_SIZE": str(slot["local_size"]),
            "HOROVOD_CROSS_RANK": str(slot["cross_rank"]),
            "HOROVOD_CROSS_SIZE": str(slot["cross_size"]),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": node0,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(int(port0) + RENDEZVOUS_OFFSET),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}


def serve_rendezvous(addresses: list[str]):
    """Starts Horovod's Gloo rendezvous (the HTTP key-value store horovodrun runs) on task 0's
    node, for the tasks at `addresses`; returns the server (`.shutdown()` when the job ends).
    Like horovodrun's, it takes requests from any caller on the network: see the Security page."""
    import threading

    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    node0, port0 = addresses[0].rsplit(":", 1)
    server = RendezvousHTTPServer((node0, int(port0) + RENDEZVOUS_OFFSET), RendezvousHandler, 0)
    server.init([SlotInfo(**slot) for slot in horovod_slots(addresses)])
    threading.Thread(target=server.serve_forever, name="tfdist-rendezvous", daemon=True).start()
    return server
