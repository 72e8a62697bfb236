"""The `tfdist` command.

    tfdist train --config configs/default.yaml [--set train.epochs=3 ...]
    tfdist bench --suite engines|compression|local_sgd|memory|pipeline [--quick]
    tfdist bench --suite comm [--quick] [--hosts 2,4] [--bandwidths 100mbit,1gbit] [--algorithms ...]
    tfdist info
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

FLAGS = flags.FLAGS
COMMANDS = ("train", "bench", "info")

flags.DEFINE_string("config", None, "Path to a YAML config (see configs/).")
flags.DEFINE_multi_string("set", [], "Override a config value: --set section.key=value "
                          "(repeatable), e.g. --set train.epochs=3.")
flags.DEFINE_enum("suite", "engines",
                  ["engines", "compression", "local_sgd", "memory", "pipeline", "comm"],
                  "Benchmark suite to run.")
flags.DEFINE_list("hosts", None, "Benchmark comm: numbers of emulated hosts (default: the spec's).")
flags.DEFINE_list("bandwidths", None, "Benchmark comm: link bandwidths with a unit, e.g. "
                  "100mbit,1gbit (default: the spec's).")
flags.DEFINE_list("algorithms", None, "Benchmark comm: algorithms of configs/bench/comm.yaml "
                  "(default: all; the baseline always runs).")
flags.DEFINE_bool("quick", False, "Benchmark: fewer steps and repeats.")
flags.DEFINE_integer("steps", None, "Benchmark: timed steps per repeat.")
flags.DEFINE_integer("repeats", None, "Benchmark: repeats per engine (interleaved).")
flags.DEFINE_string("out", "runs/bench", "Benchmark: output directory (table and JSON).")


def _usage(message: str) -> None:
    raise app.UsageError(f"{message}\nUsage: tfdist {{{'|'.join(COMMANDS)}}} [flags]; "
                         "tfdist --helpfull lists the flags.")


def cmd_train() -> int:
    from tfdist.tools.config import ConfigError, load_config

    try:
        config = load_config(FLAGS.config or "configs/default.yaml", FLAGS.set)
    except ConfigError as e:
        print(f"tfdist train: {e}", file=sys.stderr)
        return 2
    from tfdist.tools.runner import train

    summary = train(config)
    if "summary_path" in summary:
        _print_summary(summary)
    return 0


def _print_summary(s: dict) -> None:
    dense = s["gradient_bytes_per_round"]
    print()
    print(f"engine            {s['engine']} ({s['world_size']} workers/replicas)")
    print(f"test accuracy     {s['test_accuracy']:.4f} on {s['test_examples']} held-out examples")
    print(f"train loss        {s['final_train_loss']:.4f} (accuracy "
          f"{s['final_train_accuracy']:.4f}, last epoch)")
    comp = s["compressor"]["name"] if s["compressor"] else "none (dense all-reduce)"
    if s.get("averaging_period"):
        avg = s["config"]["averaging"]
        comp = f"none; local SGD, averaging every {s['averaging_period']} steps"
        if avg.get("intra_period"):
            comp += (f" (and within each host of {avg['host_size'] or 'its devices'} every "
                     f"{avg['intra_period']})")
    print(f"compression       {comp}")
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
    print(f"collectives/step  {s['collectives_per_step']:.2f} collective calls per worker")
    if s["bytes_ratio_vs_dense"] is not None:
        print(f"vs dense          {s['bytes_ratio_vs_dense']:.4f} of the "
              f"{s['dense_bytes_per_step']:,.0f} bytes/step a dense all-reduce sends")
    print(f"time              {s['train_seconds']:.1f} s")
    print(f"summary           {s['summary_path']}")


def cmd_info() -> int:
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
    print(json.dumps(info, indent=2))
    return 0


def cmd_bench() -> int:
    from tfdist.tools.bench.suites import run_suite

    if FLAGS.suite == "comm":
        from tfdist.tools.bench.comm import run_comm
        from tfdist.tools.config import ConfigError

        try:
            run_comm(FLAGS.quick, FLAGS.out, FLAGS.hosts, FLAGS.bandwidths, FLAGS.algorithms)
        except ConfigError as e:
            print(f"tfdist bench: {e}", file=sys.stderr)
            return 2
        return 0

    run_suite(FLAGS.suite, quick=FLAGS.quick, steps=FLAGS.steps, repeats=FLAGS.repeats,
              out=FLAGS.out)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        _usage("Missing command.")
    if len(argv) > 2:
        _usage(f"Unexpected arguments: {' '.join(argv[2:])}.")
    command = argv[1]
    if command not in COMMANDS:
        _usage(f"Unknown command {command!r}.")
    return {"train": cmd_train, "bench": cmd_bench, "info": cmd_info}[command]()


def run() -> None:
    """Console-script entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
