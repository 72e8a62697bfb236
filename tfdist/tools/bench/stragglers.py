"""`tfdist bench --suite stragglers`: who waits for a slow worker, on the emulated cluster.

One emulated host (configs/bench/stragglers.yaml: `straggler.host`) runs under a CPU quota of
1/`straggler.slowdown` of an equal share of this machine's cores among the hosts (a cgroup v1
CFS quota, stated in the output). Every algorithm trains the same job as one worker per host:
synchronous all-reduce, local SGD, and parameter-server training with staleness 0, s (bounded)
and none (asynchronous), the servers on host 0. Per run: time to the target accuracy (the
chief's epochs), final accuracy, the staleness of the applied gradients, bytes and step time.
Writes OUT/stragglers.md, OUT/stragglers.json (`rows`: one per run with `algorithm` and
`time_to_target_s`) and OUT/stragglers_accuracy.png, with each run's logs under
OUT/stragglers/.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from tfdist.tools import emulated
from tfdist.tools.bench import comm
from tfdist.tools.bench.machine import stamp
from tfdist.tools.config import ConfigError, configs_dir, read_yaml_mapping

SPEC = "stragglers.yaml"
SPEED_UP_CHECK = 1.5  # bounded staleness or asynchronous training: this much sooner than sync
ACCURACY_SLACK = 0.01  # ... ending within 1 point of sync's final accuracy


def load(spec_path: str | Path | None = None, quick: bool = False, hosts=None, bandwidths=None,
         algorithms=None) -> tuple[comm.Plan, dict[str, Any]]:
    """The comm plan of the spec and its straggler {host, slowdown}; everything checked before
    anything runs (ConfigError names the value and the fix)."""
    path = Path(spec_path) if spec_path else configs_dir() / "bench" / SPEC
    spec = read_yaml_mapping(path, "benchmark spec")
    straggler = spec.pop("straggler", None)
    if not isinstance(straggler, dict) or set(straggler) != {"host", "slowdown"}:
        raise ConfigError(f"{path}: straggler: give {{host: INDEX, slowdown: FACTOR}}; got "
                          f"{straggler!r}")
    slowdown = straggler["slowdown"]
    if not isinstance(slowdown, (int, float)) or isinstance(slowdown, bool) or slowdown < 1:
        raise ConfigError(f"{path}: straggler.slowdown: got {slowdown!r}; must be a number >= 1")
    with tempfile.TemporaryDirectory(prefix="tfdist-stragglers-") as directory:
        comm_spec = Path(directory) / SPEC
        comm_spec.write_text(yaml.safe_dump(spec, sort_keys=False))
        plan = comm.load_plan(comm_spec, quick, hosts, bandwidths, algorithms)
    plan.spec_path = path
    host = straggler["host"]
    for n in plan.hosts:
        if not isinstance(host, int) or isinstance(host, bool) or not 0 < host < n:
            raise ConfigError(f"{path}: straggler.host: got {host!r}; must be a worker host in "
                              f"[1, {n}) (host 0 is the chief, and holds the parameter servers)")
    return plan, {"host": host, "slowdown": float(slowdown)}


def cpu_share(hosts: int, slowdown: float) -> float:
    """The straggler's quota in cores: an equal share of this machine's cores / `slowdown`."""
    return (os.cpu_count() or 1) / hosts / slowdown


def _row(plan: comm.Plan, hosts: int, link: str, algo: comm.Algorithm, s: dict) -> dict:
    row = comm._row(plan, hosts, link, algo, s)
    ps = s.get("parameter_server") or {}
    row.update(staleness=s["config"]["engine"]["staleness"] if ps else None,
               staleness_mean=ps.get("staleness_mean"), staleness_max=ps.get("staleness_max"),
               staleness_histogram=ps.get("staleness_histogram"),
               updates=ps.get("version"), workers_lost=ps.get("workers_lost"))
    return row


def run(plan: comm.Plan, straggler: dict, out_dir: Path, command: str) -> list[dict]:
    """Runs the plan with the straggler; writes the outputs after every run."""
    out_dir = out_dir.resolve()  # the hosts' shared storage
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = comm.Progress(len(plan.hosts) * len(plan.bandwidths) * len(plan.algorithms))
    rows: list[dict] = []
    failures: list[str] = []
    for hosts in plan.hosts:
        share = cpu_share(hosts, straggler["slowdown"])
        for link in plan.bandwidths:
            with emulated.EmulatedCluster(hosts, link, plan.delay, slow_host=straggler["host"],
                                          cpu_share=share, shared=[out_dir]) as cluster:
                for algo in plan.algorithms:
                    where = f"{hosts} hosts @ {link}"
                    progress.begin(f"{where}: {algo.label}")
                    run_dir = out_dir / "stragglers" / f"{hosts}hosts-{link}" / algo.key
                    try:
                        s = comm._run(cluster, plan.configs[(hosts, algo.key)], run_dir,
                                      plan.timeout, progress)
                    except RuntimeError as e:
                        failures.append(f"{where}, {algo.key}: {e}")
                        progress.end(f"FAILED ({str(e).splitlines()[0]})")
                        continue
                    row = _row(plan, hosts, link, algo, s)
                    row["straggler"] = {**straggler, "cpu_share": round(share, 4)}
                    rows.append(row)
                    progress.end(f"accuracy {row['final_accuracy']:.4f}, time to target "
                                 f"{comm._fmt_time(row['time_to_target_s'])} s")
                    write(plan, straggler, rows, failures, out_dir, command)
    write(plan, straggler, rows, failures, out_dir, command)
    if failures:
        raise RuntimeError(f"{len(failures)} runs failed:\n" + "\n".join(failures))
    return rows


def table(target_accuracy: float, rows: list[dict]) -> str:
    lines = [f"| hosts | link | algorithm | time to {target_accuracy:.0%} (s) | speed-up vs "
             "first row | final accuracy | vs first row (pt) | staleness mean / max | step time "
             "(ms, chief) | bytes/step/worker |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    base: dict[tuple, dict] = {}
    for r in rows:
        b = base.setdefault((r["hosts"], r["bandwidth"]), r)
        speedup = (f"{b['time_to_target_s'] / r['time_to_target_s']:.2f}x"
                   if b["time_to_target_s"] and r["time_to_target_s"] else "n/a")
        stale = ("-" if r.get("staleness_mean") is None else
                 f"{r['staleness_mean']:.2f} / {r['staleness_max']}")
        lines.append(
            f"| {r['hosts']} | {r['bandwidth']} | {r['label']} | "
            f"{comm._fmt_time(r['time_to_target_s'])} | {speedup} | {r['final_accuracy']:.4f} | "
            f"{100 * (r['final_accuracy'] - b['final_accuracy']):+.1f} | {stale} | "
            f"{r['step_ms']:.0f} | {r['bytes_per_step']:,.0f} |")
    return "\n".join(lines)


def page_table(result: dict) -> str:
    """The benchmark page's table and check, from the suite's JSON."""
    return f"{table(result['target_accuracy'], result['rows'])}\n\n{check(result['rows'])}"


def check(rows: list[dict]) -> str:
    """Whether bounded-staleness or asynchronous training reached the target at least
    SPEED_UP_CHECK x sooner than the first row (synchronous), within ACCURACY_SLACK of its final
    accuracy, per (hosts, link): the fastest such run is judged (the fastest of all when none
    ends within the slack)."""
    lines = []
    for key in sorted({(r["hosts"], r["bandwidth"]) for r in rows}):
        here = [r for r in rows if (r["hosts"], r["bandwidth"]) == key]
        sync = here[0]
        candidates = [r for r in here if r.get("staleness_mean") is not None
                      and r.get("staleness") != 0]
        relaxed = [r for r in candidates if r["time_to_target_s"]]
        why = ("no bounded-staleness or asynchronous run" if not candidates else
               f"{sync['label']} missed the target" if not sync["time_to_target_s"] else
               "every bounded-staleness or asynchronous run missed the target"
               if not relaxed else None)
        if why:
            lines.append(f"- {key[0]} hosts @ {key[1]}: not judged ({why})")
            continue
        within = [r for r in relaxed
                  if r["final_accuracy"] >= sync["final_accuracy"] - ACCURACY_SLACK]
        best = min(within or relaxed, key=lambda r: r["time_to_target_s"])
        ratio = sync["time_to_target_s"] / best["time_to_target_s"]
        close = bool(within)
        verdict = "passes" if ratio >= SPEED_UP_CHECK and close else "FAILS"
        lines.append(f"- {key[0]} hosts @ {key[1]}: {best['label']} reached the target "
                     f"{ratio:.2f}x sooner than {sync['label']}, final accuracy "
                     f"{100 * (best['final_accuracy'] - sync['final_accuracy']):+.1f} pt: "
                     f"{verdict} (needs >= {SPEED_UP_CHECK}x, within "
                     f"{100 * ACCURACY_SLACK:g} pt)")
    return "\n".join(lines)


def plot(rows: list[dict], target_accuracy: float, path: Path) -> Path:
    from tfdist.tools.bench.plots import pyplot

    plt = pyplot()

    keys = sorted({(r["hosts"], r["bandwidth"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(max(9.5, 6 * len(keys)), 5.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for r in rows:
            if (r["hosts"], r["bandwidth"]) == key:
                t, a, _ = zip(*r["curve"])
                ax.plot(t, a, marker="o", ms=3, label=r["label"])
        ax.axhline(target_accuracy, color="grey", lw=0.8, ls=":")
        ax.set(title=f"{key[0]} hosts, {key[1]} links, one straggler",
               xlabel="training time of the chief (s)", ylabel="test accuracy")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.045 * ((len(labels) + 1) // 2), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def describe(straggler: dict, hosts: int) -> str:
    share = cpu_share(hosts, straggler["slowdown"])
    return (f"host {straggler['host']} of {hosts} is the straggler: a CPU quota of {share:.3f} "
            f"cores (cgroup v1 CFS, 10 ms period) = 1/{straggler['slowdown']:g} of an equal "
            f"share of this machine's {os.cpu_count()} cores among the {hosts} hosts")


def write(plan: comm.Plan, straggler: dict, rows: list[dict], failures: list[str],
          out_dir: Path, command: str) -> None:
    where = "; ".join(describe(straggler, n) for n in plan.hosts)
    (out_dir / "stragglers.md").write_text(
        f"Command: `{command}`\n\n{where}.\n\n{table(plan.target_accuracy, rows)}\n\n"
        f"{check(rows)}\n")
    (out_dir / "stragglers.json").write_text(json.dumps(
        {**stamp(command),
         "spec": str(plan.spec_path), "straggler": straggler,
         "target_accuracy": plan.target_accuracy, "job": plan.job, "failures": failures,
         "rows": rows}, indent=2))
    if rows:
        plot(rows, plan.target_accuracy, out_dir / "stragglers_accuracy.png")


def run_stragglers(quick: bool, out: str, hosts=None, bandwidths=None, algorithms=None,
                   spec: str | None = None) -> list[dict]:
    plan, straggler = load(spec, quick, hosts, bandwidths, algorithms)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "tfdist bench --suite stragglers" + (" --quick" if quick else "")
    for flag, value in (("hosts", hosts), ("bandwidths", bandwidths),
                        ("algorithms", algorithms)):
        if value is not None:
            command += f" --{flag} {','.join(map(str, value))}"
    print(f"bench: stragglers: {len(plan.algorithms)} algorithms on {plan.hosts} hosts x "
          f"{plan.bandwidths} links; {describe(straggler, plan.hosts[0])}", flush=True)
    try:
        rows = run(plan, straggler, out_dir, command)
    finally:
        print(f"bench: wrote {out_dir / 'stragglers.md'}, {out_dir / 'stragglers.json'} and "
              f"{out_dir / 'stragglers_accuracy.png'}", file=sys.stderr)
    print(table(plan.target_accuracy, rows))
    print(check(rows))
    return rows


__all__ = ["check", "cpu_share", "load", "run_stragglers", "table"]
