"""A worker process for multi-process tests: trains `common.train` and saves its weights.

    python tests/workers/train_worker.py --engine multi_worker|horovod --out DIR [options]
    python tests/workers/train_worker.py --jobs JOBS.json

Writes DIR/rank{R}.npz and DIR/rank{R}.json (bytes sent, rounds) and prints DONE. `--jobs` runs
several jobs of one engine one after another in this process (TF_CONFIG jobs share one
tfdist.MultiWorkerMirroredStrategy), each its own fit from a fresh Keras
session: JOBS.json maps a name to the job's options (each with its own --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.workers import common  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", default=None, help="a JSON file: {name: [options of one job]}")
    p.add_argument("--engine", choices=["multi_worker", "horovod"])
    p.add_argument("--out")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--accumulation-steps", type=int, default=1)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--keras-update", action="store_true",
                   help="fused_update=False: Keras' own update, compared to the bit")
    p.add_argument("--mismatch-rank", type=int, default=-1,
                   help="this rank builds a wider hidden layer than the others")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--precision", default="float32")
    p.add_argument("--compressor", default=None, help="JSON config of a tfdist compressor")
    p.add_argument("--min-compress-size", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--local-sgd", type=int, default=0, help="local SGD period (0: off)")
    p.add_argument("--strategy-local-sgd", type=int, default=0,
                   help="period for tfdist.MultiWorkerLocalSGDStrategy (0: off)")
    p.add_argument("--levels", default=None,
                   help="INTRA,INTER,HOST_SIZE: hierarchical local SGD (warm-up 1)")
    p.add_argument("--zero", type=int, default=0, help="ZeroOptimizer stage (0: off)")
    p.add_argument("--offload", default=None, help="ZeroOptimizer offload: cpu or disk")
    p.add_argument("--auto-exchange", action="store_true",
                   help="the exchange picked from the measured link (AutoExchange)")
    p.add_argument("--accordion", action="store_true",
                   help="train with Adaptive(TopK(0.5), TopK(0.05)) + Accordion(interval=2)")
    p.add_argument("--strategy-compressor", default=None,
                   help="JSON compressor config for tfdist.MultiWorkerCompressedStrategy")
    p.add_argument("--checkpoint", default=None,
                   help="fit with tfdist.callbacks.ModelCheckpoint(PATH, save_best_only) on "
                   "every rank")
    p.add_argument("--save-on-rank0-only", default=None,
                   help="after fit, model.save(PATH) on rank 0 while the others wait (horovod)")
    p.add_argument("--step-logs", default="averaged", choices=["averaged", "local"],
                   help="tfdist.MultiWorkerMirroredStrategy(step_logs=...); records the logs")
    p.add_argument("--plain-strategy", action="store_true",
                   help="use tf.distribute.MultiWorkerMirroredStrategy instead of tfdist's")
    return p


def main() -> None:
    p = _parser()
    args = p.parse_args()
    if not args.jobs:
        if not (args.engine and args.out):
            p.error("give --engine and --out, or --jobs")
        run(args)
        return
    import keras

    with open(args.jobs) as f:
        jobs = {name: p.parse_args(options) for name, options in json.load(f).items()}
    engines = {job.engine for job in jobs.values()}
    for name, job in jobs.items():
        # One process holds one TF_CONFIG strategy (shared by the jobs), and one set of
        # Horovod process sets.
        if len(engines) > 1 or job.levels or not job.out or job.mismatch_rank >= 0 or \
                job.strategy_local_sgd or job.strategy_compressor or job.plain_strategy or \
                job.step_logs != "averaged":
            p.error(f"job {name!r}: --jobs runs jobs of one engine (Horovod, or tfdist's "
                    "MultiWorkerMirroredStrategy) with an --out and no --levels, --mismatch-rank "
                    "or strategy options")
    strategy = None
    for name, job in jobs.items():
        print(f"JOB {name}", flush=True)
        strategy = run(job, strategy)
        keras.backend.clear_session()


def run(args: argparse.Namespace, strategy=None):
    """Runs one job; returns its TF_CONFIG strategy (given, or made here) for the next."""
    import keras
    import tensorflow as tf

    import tfdist

    keras.config.set_dtype_policy(args.precision)
    if args.engine == "horovod":
        import tfdist.horovod as thvd

        thvd.init(process_sets="dynamic" if args.levels else None)
        rank = thvd.rank()
        engine, strategy = "horovod", None
    else:
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=args.timeout)
        if strategy is not None:  # the job before's, in this process
            pass
        elif args.strategy_local_sgd:
            strategy = tfdist.MultiWorkerLocalSGDStrategy(
                args.strategy_local_sgd, warmup_steps=1, communication_options=options)
        elif args.strategy_compressor:
            strategy = tfdist.MultiWorkerCompressedStrategy(
                json.loads(args.strategy_compressor), communication_options=options)
        elif args.plain_strategy:
            strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        else:
            strategy = tfdist.MultiWorkerMirroredStrategy(communication_options=options,
                                                          step_logs=args.step_logs)
        rank = strategy.cluster_resolver.task_id
        engine = "strategy"
    hidden = (args.hidden,) if args.hidden else common.HIDDEN
    if rank == args.mismatch_rank:
        hidden = (hidden[0] + 1,)
    extra = {}
    if args.compressor:
        extra = {"compressor": json.loads(args.compressor),
                 "min_compress_size": args.min_compress_size, "compress_1d": True}
    extra = dict(extra)
    if args.strategy_compressor or args.strategy_local_sgd:
        extra["wrap"] = False
    if args.keras_update:
        extra["fused_update"] = False
    if args.local_sgd:
        extra["local_sgd"] = tfdist.averaging.PeriodicSchedule(args.local_sgd, warmup_steps=1)
    if args.levels:
        intra, inter, host = (int(v) for v in args.levels.split(","))
        extra["local_sgd"] = tfdist.averaging.HierarchicalSchedule(intra, inter, 1, host)
    if args.zero:
        extra["zero_stage"] = args.zero
        if args.offload:
            extra["offload"] = tfdist.zero.Offload(args.offload, budget_bytes=8192)
    accordion = None
    if args.accordion:
        accordion = tfdist.callbacks.Accordion(eta=0.2, interval=2)
        extra.update(compressor={"name": "adaptive", "low": {"name": "topk", "ratio": 0.5},
                                 "high": {"name": "topk", "ratio": 0.05}},
                     min_compress_size=1024, callbacks=[accordion])
    if args.auto_exchange:
        extra["algorithm"] = "auto"
    if args.checkpoint:  # save_best_only: the ranks' losses differ, rank 0's decides
        checkpoint = tfdist.callbacks.ModelCheckpoint(args.checkpoint, monitor="loss",
                                                      save_best_only=True)
        # This rank's own temporary directory: what a rank other than the chief leaves there.
        tempfile.tempdir = os.path.join(args.out, f"tmp-rank{rank}")
        os.makedirs(tempfile.tempdir, exist_ok=True)
        listings: list[list[str]] = []  # its contents after each epoch's save, during training
        extra["callbacks"] = [*extra.get("callbacks", []), checkpoint, keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: listings.append(sorted(os.listdir(tempfile.tempdir))))]
    step_losses: list[float] = []
    epoch_logs: list[dict] = []
    if args.engine == "multi_worker":
        extra["callbacks"] = [*extra.get("callbacks", []), keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: step_losses.append(float(logs["loss"])),
            on_epoch_end=lambda epoch, logs: epoch_logs.append(
                {k: float(v) for k, v in logs.items()}))]
    model, opt = common.train(
        engine, args.steps, args.global_batch, strategy=strategy,
        accumulation_steps=args.accumulation_steps, optimizer=args.optimizer, hidden=hidden,
        **extra,
    )
    if args.save_on_rank0_only:  # Horovod's usual way to save, which a ZeRO save cannot do
        if rank == 0:
            model.save(args.save_on_rank0_only)
        else:
            import horovod.tensorflow as hvd

            hvd.allreduce(tf.constant(0.0), name="after_save")
    os.makedirs(args.out, exist_ok=True)
    common.save_weights(model, os.path.join(args.out, f"rank{rank}.npz"))
    stats = tfdist.optimizers.chain_of(opt)  # the wrapper's, or what a strategy attached
    record = {"bytes_sent": stats.bytes_sent, "rounds": stats.communication_rounds}
    if args.checkpoint:  # where this rank's callback writes, and what it left behind
        record["checkpoint"] = checkpoint.filepath
        record["temporary_files"] = listings
    if args.engine == "multi_worker":
        record.update(step_losses=step_losses, epoch_logs=epoch_logs)
    if args.auto_exchange:
        record["auto"] = stats.part(tfdist.optimizers.AutoExchange).report()
    if accordion is not None:
        record["decisions"] = [d.astype(int).tolist() for d in accordion.decisions]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    print("DONE", flush=True)
    return strategy


if __name__ == "__main__":
    main()
