"""`tfdist bench --suite plan`: the planner (`tfdist.plan`) against the emulated cluster.

It runs the communication suite (`tfdist bench --suite comm`: the same hosts, links and
algorithms, written under OUT/comm/), or reads a run of it (`--results comm.json`), and
predicts each run's step from the job's model and the run's own zero-communication limit (the
compute step, measured in the same sweep): predicted and measured step time and bytes per
worker per step side by side, with the error. `--calibrate DIR` adds the engine's and the
compressors' own costs measured on the machine (`Calibration.from_results`).

The measured step is the mean over the run's timed steps (the first, tracing, left out), which
is what the planner predicts: for local SGD it spreads the averaging rounds over the steps.
Post-local SGD's synchronous first epoch is in the measured mean and not in the prediction.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from tfdist.plan import Calibration, Cluster, Link, Workload, predict
from tfdist.tools.bench.machine import stamp
from tfdist.tools.emulated import parse_bandwidth

# comm suite algorithm -> (planner spec, engine)
ALGORITHMS = {
    "dense_keras": ("dense", "tf.distribute"),
    "dense": ("dense", "tf.distribute"),
    "dense_horovod": ("dense", "horovod"),
    "fp16": ("fp16", "tf.distribute"),
    "ef_topk": ("topk:0.01", "tf.distribute"),
    "powersgd": ("powersgd:2", "tf.distribute"),
    "local_sgd": ("local_sgd:8", "tf.distribute"),
}
LIMIT = "limit"


def mean_step_s(row: dict[str, Any]) -> float:
    """A comm-suite run's mean step: its training time over its timed steps."""
    return row["train_seconds"] / max(row["steps"] - 1, 1)


def job_shapes(job: list[str]) -> tuple[tuple[int, ...], ...]:
    """The trainable shapes of the comm suite's job (its config overrides)."""
    from tfdist.tools.config import load_config
    from tfdist.tools.runner import load_data, make_model

    config = load_config(None, job)
    model = make_model(config, load_data(config))
    return tuple(tuple(v.shape) for v in model.trainable_variables)


def compare(results: dict[str, Any], shapes, calibrations: dict[str, Calibration]) -> list[dict]:
    """Predicted against measured, one row per run of a planned algorithm whose hosts and
    link have a zero-communication limit in `results`."""
    limits = {(r["hosts"], r["bandwidth"]): mean_step_s(r) for r in results["rows"]
              if r["algorithm"] == LIMIT}
    rows = []
    for r in results["rows"]:
        where = (r["hosts"], r["bandwidth"])
        if r["algorithm"] not in ALGORITHMS or where not in limits:
            continue
        spec, engine = ALGORITHMS[r["algorithm"]]
        cluster = Cluster(r["hosts"], Link(parse_bandwidth(r["bandwidth"]) / 1e9), engine=engine)
        (estimate,) = predict(Workload(shapes, limits[where]), cluster, [spec],
                              calibration=calibrations.get(engine)).estimates
        measured = mean_step_s(r)
        rows.append({"hosts": r["hosts"], "bandwidth": r["bandwidth"],
                     "algorithm": r["algorithm"], "label": r["label"], "spec": spec,
                     "engine": engine, "compute_ms": limits[where] * 1e3,
                     "predicted_ms": estimate.step_s * 1e3, "measured_ms": measured * 1e3,
                     "step_error": estimate.step_s / measured - 1,
                     "predicted_bytes": estimate.wire_bytes,
                     "counted_bytes": r["bytes_per_step"],
                     "bytes_error": (estimate.wire_bytes / r["bytes_per_step"] - 1
                                     if r["bytes_per_step"] else None)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| hosts | link | algorithm | compute (ms) | predicted step (ms) | measured step "
             "(ms) | error | predicted bytes/step | counted bytes/step | error |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bytes_error = "" if r["bytes_error"] is None else f"{r['bytes_error']:+.1%}"
        lines.append(f"| {r['hosts']} | {r['bandwidth']} | {r['label']} | "
                     f"{r['compute_ms']:,.0f} | {r['predicted_ms']:,.0f} | "
                     f"{r['measured_ms']:,.0f} | {r['step_error']:+.1%} | "
                     f"{r['predicted_bytes']:,.0f} | {r['counted_bytes']:,.0f} | {bytes_error} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    errors = [abs(r["step_error"]) for r in rows]
    within = sum(e <= 0.2 for e in errors)
    return (f"step time: median error {statistics.median(errors):.1%}, {within} of "
            f"{len(errors)} runs within 20%" if errors else "no run to compare")


def run_plan(quick: bool, out: str, hosts=None, bandwidths=None, algorithms=None,
             results: str | None = None, calibrate: str | None = None) -> list[dict]:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(algorithms or ()) - set(ALGORITHMS))
    if unknown:
        raise ValueError(f"--algorithms: the planner predicts {', '.join(ALGORITHMS)}; "
                         f"not {', '.join(unknown)}")
    calibrations = ({engine: Calibration.from_results(calibrate, engine)
                     for engine in ("tf.distribute", "horovod")} if calibrate else {})
    if results is None:
        from tfdist.tools.bench.comm import run_comm

        run_comm(quick, str(out_dir / "comm"), hosts, bandwidths,
                 algorithms or list(ALGORITHMS))
        results = str(out_dir / "comm" / "comm.json")
    if not Path(results).is_file():
        raise ValueError(f"--results {results!r} does not exist: give a comm.json written by "
                         "`tfdist bench --suite comm`")
    data = json.loads(Path(results).read_text())
    rows = compare(data, job_shapes(data["job"]), calibrations)
    head = (f"Predicted by `tfdist.plan` for `{data['command']}` (measured {data['date']}, "
            f"{data['machine']}); calibration: "
            f"{calibrations['tf.distribute'].source if calibrations else 'none'}.")
    text = "\n\n".join([head, table(rows), summary(rows)]) + "\n"
    (out_dir / "plan.md").write_text(text)
    command = f"tfdist bench --suite plan --results {results}" + (
        f" --calibrate {calibrate}" if calibrate else "")
    (out_dir / "plan.json").write_text(json.dumps(
        {**stamp(command), "measured": {k: data[k] for k in ("command", "date", "machine")},
         "rows": rows}, indent=2) + "\n")
    print(text)
    print(f"bench: wrote {out_dir / 'plan.md'} and {out_dir / 'plan.json'}")
    return rows
