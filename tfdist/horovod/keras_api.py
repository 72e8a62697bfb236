"""Horovod's Keras API (`horovod.tensorflow.keras`) on tfdist: a Horovod script moves by changing
its import to `import tfdist.horovod as hvd`.

Every name and argument a Horovod Keras script uses is accepted with Horovod's meaning, mapped
onto tfdist's parts; what tfdist cannot do as Horovod does is refused with the error naming the
alternative, never ignored. tfdist's own names (`tfdist.DistributedOptimizer(...,
compressor=..., accumulation_steps=...)`) stay the documented ones.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist.arguments import check_int
from tfdist.comm.horovod import import_horovod
from tfdist.optimizers import SHORTCUTS, SumOverRanks, parts_from_shortcuts
from tfdist.optimizers import DistributedOptimizer as _DistributedOptimizer

# Horovod's reduction ops (horovod.tensorflow.Average, Sum, Adasum): names here, checked below.
Average, Sum, Adasum = "Average", "Sum", "Adasum"


class Compression:
    """Horovod's `hvd.Compression`: `none` (the dense exchange) or `fp16` (tfdist's FP16
    compressor: half the bytes, the same all-reduce).

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(), compression=hvd.Compression.fp16)
        ```
    """

    none = None
    fp16 = "fp16"


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,  # noqa: N802
                         use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op=Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups=None, process_set=None, scale_local_gradients: bool = True,
                         **tfdist_options) -> _DistributedOptimizer:
    """`hvd.DistributedOptimizer` with Horovod's arguments: a `tfdist.DistributedOptimizer`.

    Mapped: `compression=Compression.fp16` -> the FP16 compressor on every tensor, biases too
    (as Horovod; tfdist's own default leaves tensors under 1,024 values dense);
    `backward_passes_per_step=k`
    -> `accumulation_steps=k` (tfdist averages the k passes' gradients, which is Horovod's
    `average_aggregated_gradients=True`); `op=Average` -> the mean over ranks, `op=Sum` -> their
    sum (`tfdist.optimizers.SumOverRanks`);
    `gradient_predivide_factor` -> the same mean (dividing before or after the sum gives the
    same average); `sparse_as_dense`, `num_groups`, `groups` -> the same result (tfdist
    exchanges an embedding's rows as rows and buckets dense gradients itself). `name`,
    `use_locking` and empty `device_dense`/`device_sparse` do nothing under Keras 3, as in
    Horovod. Any other tfdist keyword (`compressor=`, `local_sgd=`, ...) passes through.

    Raises:
        ValueError: `op=Adasum` (or `Sum` with local SGD), `backward_passes_per_step > 1` with
            Horovod's default `average_aggregated_gradients=False` (a sum of the passes), a
            process set, a device, or `scale_local_gradients=False`: each message names what to
            use instead.

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()),
                                             compression=hvd.Compression.fp16,
                                             backward_passes_per_step=4)  # Horovod's own arguments
        ```
    """
    op_name = getattr(op, "__name__", op)
    op_name = {"Average": Average, "Sum": Sum, "Adasum": Adasum}.get(str(op_name), op)
    if op_name == Sum and tfdist_options.get("local_sgd") is not None:
        raise ValueError("op=hvd.Sum sums the exchanged gradients; local SGD's local steps "
                         "exchange none: use op=hvd.Average with local_sgd.")
    if op_name == Adasum:
        raise ValueError("op=hvd.Adasum is not implemented by tfdist; use op=hvd.Average "
                         "(optionally with compression or local SGD: tfdist.DistributedOptimizer"
                         "(opt, compressor=..., local_sgd=...)).")
    if op_name not in (Average, Sum):
        raise ValueError(f"`op` must be hvd.Average or hvd.Sum. Received: op={op!r}")
    check_int("backward_passes_per_step", backward_passes_per_step, 1)
    if backward_passes_per_step > 1 and not average_aggregated_gradients:
        raise ValueError(
            f"backward_passes_per_step={backward_passes_per_step} with "
            "average_aggregated_gradients=False sums the passes' gradients in Horovod; tfdist "
            "averages them. Pass average_aggregated_gradients=True (and, to keep Horovod's step "
            f"size, multiply the learning rate by {backward_passes_per_step}).")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"`gradient_predivide_factor` must be > 0. Received: "
                         f"{gradient_predivide_factor!r}")
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise ValueError("A Horovod process set other than the global one is not supported by "
                         "tfdist's optimizer; train over all ranks (process_set=None).")
    if device_dense or device_sparse:
        raise ValueError("device_dense/device_sparse place Horovod's ops; tfdist places them "
                         "itself: leave them ''.")
    if not scale_local_gradients:
        raise ValueError("scale_local_gradients=False is for Horovod's local variables, which "
                         "tfdist does not have: leave it True.")
    if compression not in (Compression.none, Compression.fp16):
        raise ValueError(f"`compression` must be hvd.Compression.none or .fp16 (or pass a tfdist "
                         f"compressor as compressor=...). Received: {compression!r}")
    if compression is not None and tfdist_options.get("compressor") is not None:
        raise ValueError("Give `compression` (Horovod's) or `compressor` (tfdist's), not both.")
    del use_locking, sparse_as_dense, num_groups, groups  # the same result either way
    options = dict(tfdist_options)
    if compression is not None:  # Horovod compresses every floating-point tensor
        options["compressor"] = compression
        options.setdefault("min_compress_size", 0)
        options.setdefault("compress_1d", True)
    if backward_passes_per_step > 1:
        options["accumulation_steps"] = backward_passes_per_step
    if op_name == Average:
        return _DistributedOptimizer(optimizer, name=name, **options)
    shortcuts = {k: options.pop(k) for k in list(options) if k in SHORTCUTS}
    return _DistributedOptimizer(optimizer, SumOverRanks(), *parts_from_shortcuts(**shortcuts),
                                 name=name, **options)


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, **kwargs):
    """`hvd.allreduce` (Horovod's op, as `horovod.tensorflow.allreduce`).

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        print(hvd.allreduce(tf.constant(float(hvd.rank())), op=hvd.Sum))  # 0 + 1 = 1.0 on both
        ```
    """
    return import_horovod().allreduce(tensor, average=average, name=name, op=op,
                                      prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor, **kwargs)


def allgather(tensor, name=None, **kwargs):
    """`hvd.allgather`: every rank's tensor concatenated along axis 0.

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        print(hvd.allgather(tf.constant([hvd.rank()])))  # [0, 1] on both ranks
        ```
    """
    return import_horovod().allgather(tensor, name=name, **kwargs)


def broadcast(tensor, root_rank: int, name=None, **kwargs):
    """`hvd.broadcast`: `root_rank`'s tensor on every rank.

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        print(hvd.broadcast(tf.constant(hvd.rank()), root_rank=0))  # 0 on both ranks
        ```
    """
    return import_horovod().broadcast(tensor, root_rank, name=name, **kwargs)


def broadcast_variables(variables, root_rank: int) -> None:
    """`hvd.broadcast_variables`: assigns `root_rank`'s values to `variables` (Keras or TF).

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        model = build_model()
        hvd.broadcast_variables(model.variables, root_rank=0)  # every rank starts from rank 0's
        ```
    """
    hvd = import_horovod()
    for variable in variables:
        variable.assign(hvd.broadcast(tf.convert_to_tensor(variable), root_rank))


def join(device: str = "") -> int:
    """`hvd.join`: waits for every rank; returns the last rank to join.

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        last = hvd.join()  # a rank that ran out of data waits here for the others
        ```
    """
    return int(import_horovod().join())


def local_size() -> int:
    """`hvd.local_size`: the number of ranks on this process's host.

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        print(hvd.local_size(), "ranks on this host")
        ```
    """
    return int(import_horovod().local_size())


def cross_rank() -> int:
    """`hvd.cross_rank`: the index of this process's host.

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        print("host", hvd.cross_rank(), "of", hvd.cross_size())
        ```
    """
    return int(import_horovod().cross_rank())


def cross_size() -> int:
    """`hvd.cross_size`: the number of hosts.

    Example:
        ```python
        # horovodrun -np 2 python train.py
        import tfdist.horovod as hvd

        hvd.init()
        print(hvd.cross_size(), "hosts")
        ```
    """
    return int(import_horovod().cross_size())
