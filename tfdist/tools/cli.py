"""The `tfdist` command: train from a config, run a benchmark suite, describe the machine.

    tfdist train [--config configs/default.yaml] [--set section.key=value ...] [--verbose]
    tfdist bench --suite SUITE [--quick] [--out DIR] ...
    tfdist info
    tfdist data convert --from npz|tfrecord|images|digits [INPUT ...] --out DIR [--shard-mb MB]
    tfdist data serve dispatcher|worker --port PORT [--dispatcher HOST:PORT] [--address HOST]
    tfdist plan [--config PATH] [--parameters N --compute-ms MS] --workers N,... --link RATE ...
                [--stragglers SLOW:SLOWDOWN[:SIGMA[:LATE_S]]]

Help (`tfdist --help`, `tfdist <command> --help`) comes from the parser alone: nothing here
imports TensorFlow before a command runs (see `tfdist/__init__.py` for the package side).
TensorFlow's logs and known-harmless warnings are silenced unless `--verbose`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import os
import sys
import textwrap

COMMANDS = {
    "train": "train a model from a config (configs/*.yaml): prints the test accuracy and the "
             "bytes sent, keeps each run in its own directory",
    "bench": "run a benchmark suite and write its table (Markdown), JSON and plots",
    "info": "versions, devices and the engines available here (Horovod: Gloo/MPI/NCCL)",
    "plan": "predict each algorithm's step time, bytes and memory per device on a cluster of "
            "8 to 1,024 workers, and recommend one",
    "data": "convert data to a record set (data.name: records): each worker reads only its "
            "slice, a resume reads nothing twice; serve it through the tf.data service",
}
SUITES = {
    "engines": "step time of the tfdist engines against plain Keras + MirroredStrategy on one "
               "model and batch (1 process x 2 devices, 2 TF_CONFIG workers, 2 Horovod ranks)",
    "overhead": "what the optimizer wrapper adds to a step in a world of one (no "
                "communication): Keras' optimizer, tfdist dense and local SGD side by side, "
                "step time and weights",
    "compression": "the default job dense and with each compressor config: bytes per step, "
                   "ratio to dense, test accuracy, step time",
    "compressors": "each compressor's own work per MB of gradient (compress, pack, decompress, "
                   "error feedback; no network)",
    "local_sgd": "local SGD (periods 2-16, SlowMo, SMA, optimizer state averaged, hierarchical): "
                 "rounds, bytes, test accuracy, step time",
    "memory": "ZeRO stages 1 and 2: bytes per replica of optimizer state, parameter shard and "
              "gradient buffers, next to the formulas",
    "pipeline": "GPipe and 1F1B over K logical devices: step time, measured idle time per "
                "stage, activation memory with and without re-materialization",
    "pipeline_hosts": "GPipe, 1F1B and 2 x 2 data x pipeline with stages on emulated hosts "
                      "(root, iproute2): step time, bytes sent between hosts per step next to "
                      "the activations and gradients that must cross",
    "comm": "algorithm x link speed on the emulated multi-host cluster (root, iproute2): time "
            "to the target accuracy, bytes counted and on the wire, collective calls, step time",
    "stragglers": "one emulated host slowed by a CPU quota (root, cgroup v1): synchronous "
                  "all-reduce, local SGD and parameter servers (staleness 0, bounded, "
                  "asynchronous): time to the target accuracy, staleness, step time",
    "models": "ResNet-50 and a BERT-like encoder (random weights, synthetic data) per algorithm "
              "on the emulated cluster: step time, images or tokens per second, scaling "
              "efficiency against the zero-communication limit",
    "plan": "the planner (tfdist plan) against the emulated cluster: runs the comm suite (or "
            "reads its comm.json or a models suite's models.json, --results) and sets "
            "predicted step time and bytes beside the measured ones, with the error; given a "
            "stragglers suite's stragglers.json, the straggler simulation beside its runs; "
            "given a memory suite's memory.json, the planned memory per replica",
    "input": "what reading the data costs: records each TF_CONFIG worker reads of a record "
             "set at 1, 2 and 4 workers, a resumed run's first batch at global batch 0, 1,000 "
             "and 10,000 against a TFRecord stream skipped to it, one device's step on arrays, records and "
             "a heavy decode, random reads of a record set against ArrayRecord",
    "collectives": "one all-reduce of 1-94 MB, whole or in parts, over tf.distribute's gRPC "
                   "collectives and Horovod's Gloo, processes on 127.0.0.1: median ms, bus "
                   "bandwidth",
}


def _listing(items: dict[str, str]) -> str:
    width = max(map(len, items)) + 4
    return "\n".join(textwrap.fill(text, 88, initial_indent=f"  {name:<{width - 2}}",
                                   subsequent_indent=" " * width)
                      for name, text in items.items())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfdist", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Distributed training for Keras 3 model.fit on TensorFlow 2.21.",
        epilog="`tfdist COMMAND --help` lists a command's options.")
    parser.add_argument("--version", action="version", version=f"tfdist {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                title="commands", help=", ".join(COMMANDS))
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true",
                         help="show TensorFlow's logs and warnings")

    train = sub.add_parser("train", parents=[verbose], help=COMMANDS["train"],
                           description=COMMANDS["train"] + ".")
    train.add_argument("--config", default=None, metavar="PATH",
                       help="a YAML config (default: configs/default.yaml where it exists, "
                            "else the built-in defaults: the same job)")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a config value (repeatable), e.g. --set train.epochs=3")

    bench = sub.add_parser("bench", parents=[verbose], help=COMMANDS["bench"],
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description=COMMANDS["bench"] + ".\n\nsuites:\n" + _listing(SUITES))
    bench.add_argument("--suite", choices=list(SUITES), default="engines",
                       help="the suite to run (default: %(default)s)")
    bench.add_argument("--quick", action="store_true", help="a shorter run of the suite")
    bench.add_argument("--out", default="runs/bench", metavar="DIR",
                       help="where the table, JSON and plots go (default: %(default)s)")
    bench.add_argument("--steps", type=int, metavar="N",
                       help="engines, overhead: timed steps per repeat")
    bench.add_argument("--repeats", type=int, metavar="R",
                       help="engines, overhead: repeats per engine; collectives: timed calls "
                            "per row")
    bench.add_argument("--hosts", type=_list, metavar="N,...",
                       help="comm, plan, models, stragglers, pipeline_hosts: numbers of emulated "
                            "hosts (default: the spec's; pipeline_hosts: 2,4); collectives: "
                            "numbers of processes on 127.0.0.1 (default: 2); compressors: "
                            "numbers of processes measured at once (default: this one)")
    bench.add_argument("--bandwidths", type=_list, metavar="RATE,...",
                       help="comm, plan, models, stragglers, pipeline_hosts: link bandwidths "
                            "with a "
                            "unit, e.g. 100mbit,1gbit")
    bench.add_argument("--algorithms", type=_list, metavar="NAME,...",
                       help="comm, plan, models, stragglers: algorithms of configs/bench/comm.yaml, "
                            "models.yaml or stragglers.yaml (the baseline always runs)")
    bench.add_argument("--models", type=_list, metavar="NAME,...",
                       help="models: the models of configs/bench/models.yaml to run")
    bench.add_argument("--sizes", type=_list, metavar="MB,...",
                       help="collectives: tensor sizes in MB (default: 1,22,94)")
    bench.add_argument("--splits", type=_list, metavar="K,...",
                       help="collectives: all-reduce calls per tensor (default: 1,2,4,8)")
    bench.add_argument("--results", metavar="PATH",
                       help="plan: a comm suite's comm.json to compare with, instead of running "
                            "the comm suite (or a models suite's models.json); or a stragglers "
                            "suite's stragglers.json, to compare "
                            "the straggler simulation with; or a memory suite's memory.json, to "
                            "compare the planned memory per replica with")
    bench.add_argument("--published", action="store_true",
                       help="plan: feed published set-ups (Horovod's 512 GPUs, the ZeRO paper's "
                            "memory by stage) to the planner and set its prediction beside the "
                            "published figures")
    bench.add_argument("--calibrate", metavar="DIR",
                       help="plan: the collectives and compressors suites' JSON that calibrate "
                            "the planner, and the overhead suite's that prices Keras' own update "
                            "(e.g. docs/benchmarks/data)")
    bench.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="comm: override the spec's job for every run (repeatable), e.g. "
                            "--set model.hidden=[256,256]")

    sub.add_parser("info", help=COMMANDS["info"], description=COMMANDS["info"] + ".")

    data = sub.add_parser("data", parents=[verbose], help=COMMANDS["data"],
                          description=COMMANDS["data"] + ".")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    convert = data_sub.add_parser(
        "convert", parents=[verbose], help="write a record set from NumPy arrays, TFRecord "
        "files, a folder of images or the embedded digits set",
        description="Writes a record set (train and test splits, TFRecord shards with their "
                    "indexes, records.json) that `data.name: records`, `data.path: DIR` "
                    "trains on. Arrays (an .npz with x and y) and images decode by themselves; "
                    "TFRecord records stay yours: name your decode function in data.decode.")
    convert.add_argument("--from", dest="source", required=True,
                         choices=("npz", "tfrecord", "images", "digits"),
                         help="npz: one .npz file holding arrays x and y; tfrecord: TFRecord "
                              "files (or globs), uncompressed, GZIP or ZLIB; images: a folder "
                              "with one subfolder of image files per class; digits: the "
                              "embedded digits set")
    convert.add_argument("inputs", nargs="*", metavar="INPUT", help="the files to convert")
    convert.add_argument("--out", required=True, metavar="DIR",
                         help="the record set's directory (new, or empty)")
    convert.add_argument("--test-fraction", type=float, default=0.2, metavar="F",
                         help="share of the records held out as the test split (default 0.2)")
    convert.add_argument("--seed", type=int, default=0, help="seed of the test split")
    convert.add_argument("--shard-mb", type=float, default=256.0, metavar="MB",
                         help="largest shard, in MB (default 256)")
    convert.add_argument("--image-size", metavar="H,W",
                         help="images: the size they decode to (default: the first image's)")
    convert.add_argument("--channels", type=int, default=3, choices=(1, 3),
                         help="images: 1 (grey) or 3 (RGB, the default)")
    serve = data_sub.add_parser(
        "serve", parents=[verbose], help="run a tf.data service dispatcher or data worker "
        "(data.service: the trainers read batches decoded there)",
        description="Runs TensorFlow's tf.data service dispatcher, or a data worker that "
                    "reads and decodes for the trainers, until stopped. Its servers listen on "
                    "every interface and check no secret: run them on a network only the job "
                    "reaches (docs/security.md).")
    serve.add_argument("role", choices=("dispatcher", "worker"))
    serve.add_argument("--port", type=int, required=True, help="the port to serve on")
    serve.add_argument("--dispatcher", metavar="HOST:PORT",
                       help="worker: the dispatcher's address")
    serve.add_argument("--address", metavar="HOST",
                       help="worker: the host name or address trainers reach it at (default "
                            "this host's name)")

    from tfdist.plan import DEFAULT_ALGORITHMS, SPEC_HELP
    from tfdist.plan.planner import ENGINES, PRECISIONS

    plan = sub.add_parser("plan", parents=[verbose], help=COMMANDS["plan"],
                          description=COMMANDS["plan"] + ". The model is the config's (or "
                          "--model-file, or --parameters); its compute step is --compute-ms, "
                          "or measured here on one device. With --parameters and --compute-ms "
                          "it is arithmetic alone: TensorFlow does not load.")
    plan.add_argument("--config", default=None, metavar="PATH",
                      help="the config whose model, data shape, optimizer and batch size are "
                           "planned (default: configs/default.yaml where it exists, else the "
                           "built-in defaults)")
    plan.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override a config value (repeatable), e.g. --set "
                           "model.name=mine:build")
    plan.add_argument("--model-file", metavar="PATH", help="a saved .keras model instead")
    plan.add_argument("--parameters", type=int, metavar="N",
                      help="a model known by its parameter count alone (with --compute-ms)")
    plan.add_argument("--compute-ms", type=float, metavar="MS",
                      help="one worker's step with no exchange, in ms (default: measured here "
                           "on one device at the config's batch size)")
    plan.add_argument("--update-saving-ms", type=float, metavar="MS",
                      help="with --compute-ms measured with a per-variable update (Keras' "
                           "own, another framework's): what tfdist's fused update saves of it, "
                           "in ms, e.g. Keras' update minus the fused one in `tfdist bench "
                           "--suite overhead` (default: 0; a step measured here is tfdist's)")
    plan.add_argument("--batch", type=int, metavar="N",
                      help="examples of one worker's step: the compute step is measured at "
                           "it, and an embedding's gradient priced as the rows it looks up "
                           "(default: the config's data.global_batch_size; 32 for --model-file)")
    plan.add_argument("--decode-ms", type=float, metavar="MS",
                      help="reading and decoding one example on one core, in ms (e.g. "
                           "`tfdist bench --suite input`'s decode cost): the plan says where "
                           "the input, not the exchange, bounds the step (default: not counted)")
    plan.add_argument("--decode-cores", type=int, default=1, metavar="C",
                      help="cores each worker decodes on, with --decode-ms (default: "
                           "%(default)s)")
    plan.add_argument("--optimizer-slots", type=int, metavar="K",
                      help="optimizer state per parameter (Adam 2, momentum 1, SGD 0; "
                           "default: counted on the config's optimizer, 2 with --parameters)")
    plan.add_argument("--precision", choices=PRECISIONS, default="float32",
                      help="float32 (tfdist's and Keras' variables, mixed_float16 included) or "
                           "mixed: float16 parameters and gradients with a float32 master copy, "
                           "as DeepSpeed and the ZeRO paper count them (default: %(default)s)")
    plan.add_argument("--workers", type=_list, default=["8", "64", "1024"], metavar="N,...",
                      help="worker counts (default: 8,64,1024)")
    plan.add_argument("--per-host", type=int, default=1, metavar="G",
                      help="workers per host, sharing its link (default: 1)")
    plan.add_argument("--link", default="10gbit", metavar="RATE",
                      help="each host's network link, e.g. 25gbit (default: %(default)s)")
    plan.add_argument("--latency-us", type=float, default=0.0, metavar="US",
                      help="one-way latency of the links in microseconds (default: 0)")
    plan.add_argument("--intra", metavar="RATE",
                      help="the link between workers of one host, e.g. 300gbit (default: "
                           "--link)")
    plan.add_argument("--engine", choices=ENGINES,
                      default="tf.distribute", help="default: %(default)s")
    plan.add_argument("--device-memory", metavar="SIZE",
                      help="one device's memory, e.g. 24GB: what needs more is not recommended")
    plan.add_argument("--algorithms", type=_list, metavar="SPEC,...",
                      help=f"{SPEC_HELP} (default: {','.join(DEFAULT_ALGORITHMS)})")
    plan.add_argument("--calibrate", metavar="DIR",
                      help="add the engine's and compressors' own costs measured by `tfdist "
                           "bench --suite collectives` and `--suite compressors` (their "
                           "JSON in DIR, e.g. docs/benchmarks/data)")
    plan.add_argument("--stragglers", metavar="SLOW:SLOWDOWN[:SIGMA[:LATE_S]]",
                      help="also simulate synchronous, local SGD (H=8), bounded-staleness (4) "
                           "and asynchronous training with this many slow workers (a count, or "
                           "a share below 1), this many times slower, a log-normal spread of "
                           "every step and a late start of the slow ones, e.g. 0.01:2:0.3 "
                           "(tfdist.plan.simulate)")
    plan.add_argument("--json", metavar="PATH", help="also write the plans as JSON")
    return parser


def _list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tfdist")
    except PackageNotFoundError:  # a source checkout that was not installed
        return "(not installed)"


def loading(verbose: bool):
    """A block that may load TensorFlow: its loading lines, logs and known-harmless warnings
    silenced unless `verbose` (`tfdist.logs.loading_quietly`)."""
    from tfdist.logs import loading_quietly

    return contextlib.nullcontext() if verbose else loading_quietly()


def _config_path(given: str | None) -> str | None:
    """The config a command reads: the one given, else configs/default.yaml where it exists,
    else None (the built-in defaults: the same job)."""
    default = os.path.join("configs", "default.yaml")
    return given if given is not None or not os.path.isfile(default) else default


def _writable(directory: str, option: str) -> None:
    """Raises ValueError, naming `option` (e.g. "--out runs/bench"), unless `directory`, where a
    command writes its results, is or can be made a directory this process may write: said
    before the run, not after it."""
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        what = "not a directory" if not os.path.isdir(existing) else "not writable"
        raise ValueError(f"{option}: {existing} is {what}; give a directory you can write")


def cmd_train(args) -> int:
    from tfdist.tools.config import ConfigError, load_config

    path = _config_path(args.config)
    try:
        with loading(args.verbose):  # the schema first: TensorFlow loads only past it
            config = load_config(path, args.set)
            from tfdist.tools import epilogue
            from tfdist.tools.runner import train
    except ConfigError as e:
        print(f"tfdist train: {e}", file=sys.stderr)
        return 2

    epilogue.last_run()  # a notice as this process exits finds the run over (exit 0)

    try:
        summary = train(config)
    except ConfigError as e:
        print(f"tfdist train: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 (the stops below are said in a line)
        stop = (_non_finite_stop(e) or _out_of_memory_stop(e) or _not_joined_stop(e, config)
                or _lost_peer_stop(e, config))
        if stop is None or args.verbose:
            raise
        print(f"tfdist train: {stop}", file=sys.stderr)
        return 1
    if "summary_path" in summary:
        _print_summary(summary)
    return 0


def _non_finite_stop(error: Exception) -> str | None:
    """One line for a run stopped by non-finite gradients (nan_policy 'raise'), else None."""
    import re

    text = str(error)
    found = re.search(r"tfdist: non-finite gradients at optimizer step\]? \[?(\d+)\]?(.*?"
                      r"\(1 = yes\):\]? \[([\d ]+)\])?", text)
    if found is None:
        return None
    ranks = [i for i, flag in enumerate((found.group(3) or "").split()) if flag == "1"]
    where = f" on rank(s) {', '.join(map(str, ranks))}" if ranks else ""
    return (f"non-finite gradients at optimizer step {found.group(1)}{where}: stopped "
            "(optimizer.nan_policy 'raise'). Look for inf/NaN in the data, lower "
            "optimizer.learning_rate, or set optimizer.nan_policy=skip to skip such steps; the "
            "backups, if any, are kept.")


def _out_of_memory_stop(error: Exception) -> str | None:
    """One line for a run whose tensors did not fit in the device's memory (TensorFlow's
    ResourceExhaustedError "OOM when allocating ..."), naming the tensor, else None."""
    import re

    text = str(error)
    found = re.search(r"OOM when allocating tensor with shape\s*\[([\d, ]*)\] and type (\w+) on "
                      r"(\S+)", text)
    if found is None:
        return None
    shape = ", ".join(d.strip() for d in found.group(1).split(",") if d.strip())
    device = found.group(3).rsplit("/device:", 1)[-1]
    return (f"out of memory: a {found.group(2)} tensor of shape [{shape}] did not fit on "
            f"{device}: stopped. Lower data.global_batch_size or the model's size, or shard "
            "the training state over the workers (optimizer.zero_stage 1-3, "
            "optimizer.offload); the backups, if any, are kept.")


# What TensorFlow's errors say when a peer is gone: its collectives aborted, its gRPC
# connection reset or closed, the coordination service's heartbeat missed.
PEER_LOST = ("Collective ops is aborted", "Socket closed", "Connection reset by peer",
             "stopped sending heartbeats", "failed to connect", "Connection refused",
             "unhealthy", "Broken pipe", "failed to answer")


def _not_joined_stop(error: Exception, config: dict) -> str | None:
    """One line for a multi-worker job whose start timed out waiting for a worker to join
    (its host down or unreachable): which, after how long, what to check; else None."""
    import re

    text = str(error)
    timeout = config["engine"]["timeout_seconds"]
    fix = ("Check that every host is up and reaches worker 0's address in TF_CONFIG (a "
           "firewall, a link down), or raise engine.timeout_seconds for slow starts. -v shows "
           "TensorFlow's traceback.")
    if "Wait_for_all_tasks_to_register" in text:  # worker 0, which leads the job's start
        listed = text.split("timed out task names:", 1)[-1].split("Additional", 1)[0]
        missing = re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", listed)
        who = ", ".join(f"{job} {task}" for job, task in dict.fromkeys(missing)) or "a worker"
        return (f"{who} did not join the job within engine.timeout_seconds ({timeout:g} s): "
                f"stopped before training. {fix}")
    if "CoordinationService/RegisterTask" in text:  # another worker, which could not join
        return (f"could not join the job led by worker 0 within engine.timeout_seconds "
                f"({timeout:g} s): stopped before training. {fix}")
    return None


def _lost_peer_stop(error: Exception, config: dict) -> str | None:
    """One line for a multi-process job that lost contact with a peer (a link down for longer
    than the job waits, a worker that died): which, why, and what resumes it; else None."""
    import re

    text = str(error)
    said = next((s for s in PEER_LOST if s in text), None)
    if said is None or "TF_CONFIG" not in os.environ:
        return None
    own = re.search(r"tfdist: ([^\]\n]+)", text)  # tfdist's own sentence (a parameter server's)
    if own is not None:
        return own.group(1).strip() + " -v shows TensorFlow's traceback."
    peer = re.search(r"/job:(\w+)/replica:\d+/task:(\d+)", text)
    who = f"{peer.group(1)} {peer.group(2)}" if peer else "a peer"
    why = re.search(r'grpc_message:"([^"]+)"', text)
    engine, train = config["engine"], config["train"]
    backups = (f"the same command resumes from the newest backup (every "
               f"{train['checkpoint_steps']} steps in {train['output_dir']}/backup)"
               if train["checkpoint_steps"] else
               "no backup was configured (train.checkpoint_steps): a new run starts over")
    heartbeat = engine.get("heartbeat_seconds")
    waited = (f"; a silent worker is waited for engine.heartbeat_seconds ({heartbeat:g} s), "
              "a connection down for about 15 s is closed by the network stack"
              if heartbeat else "")
    return (f"lost contact with {who} ({why.group(1) if why else said}): stopped; {backups}; "
            f"python -m tfdist.launch --max-restarts N starts the job again by itself{waited}. "
            "-v shows TensorFlow's traceback.")


def _print_summary(s: dict) -> None:
    from tfdist.ps.server import describe_staleness

    dense = s["gradient_bytes_per_round"]
    print()
    print(f"engine            {s['engine']} ({s['world_size']} workers/replicas)")
    for name, value in s["test_metrics"].items():
        print(f"{'test ' + name:<17} {value:.4f} on {s['test_examples']} held-out examples")
    print(f"test loss         {s['test_loss']:.4f}")
    if s["final_train_loss"] is not None:
        shown = ", ".join(f"{name} {value:.4f}" for name, value in s["final_train_metrics"].items()
                          if value is not None)
        print(f"train loss        {s['final_train_loss']:.4f} ({shown + ', ' if shown else ''}"
              "last epoch)")
    comp = s["compressor"]["name"] if s["compressor"] else "none (dense all-reduce)"
    if s.get("auto"):
        picked = s["auto"]["choice"] or "still measuring when training ended"
        comp = f"auto: {picked} (picked from the measured link; numbers in summary.json)"
    if s.get("averaging_period"):
        avg = s["config"]["averaging"]
        warmup = f"{comp} in the synchronous warm-up steps" if s["compressor"] else "none"
        comp = f"{warmup}; local SGD, averaging every {s['averaging_period']} steps"
        if avg.get("intra_period"):
            comp += (f" (and within each host of {avg['host_size'] or 'its devices'} every "
                     f"{avg['intra_period']})")
    ps = s.get("parameter_server")
    if ps:
        comp = "none (gradients pushed to the parameter servers)"
    if s.get("hogwild"):
        comp = "none (each replica's gradient written to the shared weights)"
    print(f"compression       {comp}")
    if ps:
        bound = s["config"]["engine"]["staleness"]
        rule = {0: "synchronous", None: "asynchronous"}.get(bound, f"staleness bound {bound}")
        print(f"parameter server  {rule}; {ps['version']} updates from {ps['pushes']} pushes; "
              f"staleness {describe_staleness(ps)}; "
              f"workers lost {ps['workers_lost']}")
    hogwild = s.get("hogwild")
    if hogwild:
        print(f"hogwild           {s['world_size']} replicas updating shared weights without "
              f"locks; {hogwild['version']} updates; staleness {describe_staleness(hogwild)}")
    opt = s["config"]["optimizer"]
    state = ", ".join(f"{'disk' if device.startswith('disk:') else device.split('/')[-1]}: {n:,}"
                      for device, n in s["optimizer_state_bytes"].items())
    zero = (f"ZeRO stage {opt['zero_stage']}" + (f", offload {opt['offload']}"
                                                 if opt["offload"] else "") + "; "
            if opt["zero_stage"] else "")
    print(f"optimizer state   {zero}bytes {state or 'none'}")
    print(f"bytes sent/step   {s['bytes_sent_per_step']:,.0f} per worker "
          f"({s['communication_rounds']} exchanges; {dense:,} gradient bytes per exchange; "
          f"total {s['bytes_sent_total']:,.0f})")
    calls = "RPCs (push, wait, pull)" if ps else "collective calls"
    print(f"collectives/step  {s['collectives_per_step']:.2f} {calls} per worker")
    if s["bytes_ratio_vs_dense"] is not None and not ps:
        print(f"vs dense          {s['bytes_ratio_vs_dense']:.4f} of the "
              f"{s['dense_bytes_per_step']:,.0f} bytes/step a dense all-reduce sends")
    print(f"time              {s['train_seconds']:.1f} s")
    up = s["startup_seconds"]
    print(f"start-up          {up['total']:.1f} s to the end of the first step ("
          + ", ".join(f"{name.replace('_', ' ')} {up[key]:.1f} s" for key, name in (
              ("before_train", "imports"), ("setup", "set-up"),
              ("fit_before_first_step", "fit before it"), ("first_step", "first step"))
              if up[key] is not None) + ")")
    print(f"run directory     {s['run_dir']} (summary.json" + (", model.keras" if s["model_path"]
                                                               else "") + ", tensorboard/)")


def cmd_info(args) -> int:
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.horovod import is_available

    info = {
        "tfdist": tfdist.__version__,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "devices": {kind: [d.name for d in tf.config.list_physical_devices(kind)]
                    for kind in ("CPU", "GPU")},
        "engines": {"tf.distribute": True, "horovod": is_available()},
    }
    if is_available():
        import horovod
        import horovod.tensorflow as hvd

        info["horovod"] = {"version": horovod.__version__, "gloo": bool(hvd.gloo_built()),
                           "mpi": bool(hvd.mpi_built()), "nccl": bool(hvd.nccl_built())}
    info["engine_for_several_hosts"] = engine_advice(
        gpus=bool(info["devices"]["GPU"]),
        gloo=bool(info.get("horovod", {}).get("gloo")))
    print(json.dumps(info, indent=2))
    return 0


COLLECTIVES_PAGE = "docs/benchmarks/collectives.md"


def engine_advice(gpus: bool, gloo: bool) -> dict[str, str]:
    """The engine.name `tfdist info` suggests for jobs on several hosts, and why: on CPU hosts
    Horovod's Gloo all-reduce is several times faster than tf.distribute's gRPC ring (measured by
    `tfdist bench --suite collectives`); on GPUs both engines reduce with NCCL and tfdist has
    not measured one against the other."""
    if gpus:
        return {"name": "multi_worker", "why": "GPUs: tf.distribute and Horovod both reduce with "
                "NCCL; tfdist has not measured one against the other, so tf.distribute, which "
                "needs no build"}
    if gloo:
        return {"name": "horovod", "why": "CPU hosts: Horovod's Gloo all-reduce is several "
                f"times faster than tf.distribute's gRPC ring ({COLLECTIVES_PAGE}; measure "
                "yours with `tfdist bench --suite collectives`)"}
    return {"name": "multi_worker", "why": "CPU hosts without Horovod: tf.distribute's gRPC "
            "ring; Horovod's Gloo is several times faster for the dense exchange "
            f"({COLLECTIVES_PAGE}): build it with launch/build_horovod.sh"}


def cmd_bench(args) -> int:
    from tfdist.tools.config import ConfigError

    try:
        _writable(args.out, f"--out {args.out}")
        if args.suite == "comm":
            from tfdist.tools.bench.comm import run_comm

            run_comm(args.quick, args.out, args.hosts, args.bandwidths, args.algorithms,
                     job=args.set)
        elif args.suite == "stragglers":
            from tfdist.tools.bench.stragglers import run_stragglers

            run_stragglers(args.quick, args.out, args.hosts, args.bandwidths, args.algorithms)
        elif args.suite == "pipeline_hosts":
            from tfdist.tools.bench.pipeline_hosts import run_pipeline_hosts

            run_pipeline_hosts(args.quick, args.out, args.hosts, args.bandwidths)
        elif args.suite == "models":
            from tfdist.tools.bench.models import run_models

            run_models(args.quick, args.out, args.hosts, args.bandwidths, args.algorithms,
                       models=args.models)
        elif args.suite == "plan":
            from tfdist.tools.bench.plan import run_plan

            run_plan(args.quick, args.out, args.hosts, args.bandwidths, args.algorithms,
                     results=args.results, calibrate=args.calibrate, published=args.published)
        elif args.suite == "input":
            from tfdist.tools.bench.input import run_input

            run_input(args.quick, args.out)
        elif args.suite == "collectives":
            from tfdist.tools.bench.collectives import run_collectives

            run_collectives(args.quick, args.out, args.hosts, args.sizes, args.splits,
                            args.repeats)
        else:
            from tfdist.tools.bench.suites import run_suite

            run_suite(args.suite, quick=args.quick, steps=args.steps, repeats=args.repeats,
                      out=args.out, processes=args.hosts)
    except (ConfigError, ValueError) as e:
        print(f"tfdist bench: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_plan(args) -> int:
    from tfdist.tools import planning
    from tfdist.tools.config import ConfigError, load_config

    config = None
    arithmetic = args.parameters is not None and args.compute_ms is not None
    try:
        planning.check(args)
        if args.json:
            _writable(os.path.dirname(args.json) or ".", f"--json {args.json}")
        with contextlib.nullcontext() if arithmetic else loading(args.verbose):
            if args.parameters is None and not args.model_file:
                config = load_config(_config_path(args.config), args.set)  # the schema first
            results, how = planning.plans(args, config)
    except (ConfigError, ValueError) as e:
        print(f"tfdist plan: {e}", file=sys.stderr)
        return 2
    stragglers = planning.parse_stragglers(args.stragglers) if args.stragglers else None
    simulated = [planning.simulations(p, stragglers) for p in results] if stragglers else None
    planning.report(results, how, stragglers=stragglers, simulated=simulated)
    if args.json:
        planning.write_json(results, how, args.json, simulated)
    return 0


def cmd_data(args) -> int:
    """`tfdist data convert`: a record set from arrays, TFRecord files, images or the digits set, with
    a progress line per split; `tfdist data serve`: a tf.data service server. One line on a
    mistake (exit 2)."""
    import glob

    import numpy as np

    from tfdist import data

    if args.data_command == "serve":
        from tfdist.callbacks.channel import launcher_channel
        from tfdist.data import service

        launcher_channel().listen()  # under the launcher over ssh: ends when it goes
        if not 1 <= args.port <= 65535:
            print(f"tfdist data serve: --port must be in [1, 65535]. Received: {args.port}",
                  file=sys.stderr)
            return 2
        try:
            service.serve(args.role, args.port, args.dispatcher, args.address)
        except service.ServiceError as e:
            print(f"tfdist data serve: {e}", file=sys.stderr)
            return 2
        return 0

    progress = data.records.Progress()
    common = {"test_fraction": args.test_fraction, "seed": args.seed,
              "shard_mb": args.shard_mb, "progress": progress}
    try:
        if args.source == "tfrecord":
            files = sorted(f for given in args.inputs for f in (glob.glob(given) or [given]))
            meta = data.convert_tfrecords(args.out, files, **common)
        elif args.source == "images":
            if len(args.inputs) != 1:
                raise data.RecordError("--from images converts one folder (one subfolder per "
                                       "class)")
            meta = data.convert_images(args.out, args.inputs[0], _image_size(args.image_size),
                                       args.channels, **common)
        else:
            if args.source == "digits":
                x, y = data.load_digits("all")
            elif len(args.inputs) != 1:
                raise data.RecordError("--from npz converts one .npz file holding x and y")
            else:
                with np.load(args.inputs[0], allow_pickle=False) as arrays:
                    if not {"x", "y"} <= set(arrays.files):
                        raise data.RecordError(f"{args.inputs[0]}: holds {arrays.files}; it "
                                               "needs arrays named x and y")
                    x, y = arrays["x"], arrays["y"]
            meta = data.convert_arrays(args.out, x, y, **common)
    except (OSError, ValueError) as e:
        progress.done()  # its line before the error's
        print(f"tfdist data convert: {e}", file=sys.stderr)
        return 2
    finally:
        progress.done()
    splits = ", ".join(f"{n['records']:,} {split} records in {n['shards']} shard(s)"
                       for split, n in meta["splits"].items())
    print(f"record set        {args.out}: {splits}")
    print(f"train on it       tfdist train --set data.name=records --set data.path={args.out}"
          + ("" if meta["source"] in ("arrays", "images")
             else " --set data.decode=module:function --set data.num_classes=N"))
    return 0


def _image_size(text: str | None) -> tuple[int, int] | None:
    """--image-size H,W."""
    if text is None:
        return None
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--image-size {text!r}: give height,width in pixels, e.g. 224,224")
    return int(parts[0]), int(parts[1])


TOOLS_EXTRA = "pip install 'tfdist[tools]'"  # PyYAML (configs) and matplotlib (plots)


def main(argv: list[str] | None = None) -> int:
    # At exit, the objects still alive (TensorFlow's and Keras' millions of module objects among
    # them) are moved out of the garbage collector's reach: the interpreter's last collections
    # then skip them, which took about a second of every TensorFlow process's exit on the 2-core
    # test machine. Objects are still finalized as their references go. The command's own
    # process only: the library registers nothing at import.
    atexit.register(gc.freeze)
    args = build_parser().parse_args(argv)
    try:
        import yaml  # noqa: F401
    except ImportError:
        print(f"tfdist: the command reads YAML configs and needs PyYAML: {TOOLS_EXTRA} "
              "(launch/setup.sh installs it)", file=sys.stderr)
        return 2
    if args.command not in ("train", "plan"):
        with loading(getattr(args, "verbose", False)):
            import tensorflow  # noqa: F401
    return {"train": cmd_train, "bench": cmd_bench, "info": cmd_info,
            "plan": cmd_plan, "data": cmd_data}[args.command](args)


def run() -> None:
    """Console-script entry point. Your own `module:function` (model.name, data.name) imports
    from the working directory, as under `python -m`."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    sys.exit(main())


if __name__ == "__main__":
    run()
