"""One model-averaging round over a communicator: exact (optionally with an outer rule, or
within groups of replicas) or ring gossip. Each replica updates its own copy of each variable."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfdist.averaging.outer import OuterRule
from tfdist.comm import Communicator


def average(comm: Communicator, variables: Sequence, outer: OuterRule | None = None,
            anchors: Sequence = (), buffers: Sequence = (), first=False,
            group_size: int | None = None) -> None:
    """Replaces each variable by its mean over the replicas, in one all-reduce.

    With `outer`, the first len(anchors) variables take its update (`outer.update`) from the
    mean, with their `anchors` and `buffers`; `first` tells it this is the first round. With
    `group_size`, the mean is over each group of that many consecutive replicas (a host) only.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            v = tf.Variable(0.0, aggregation=tf.VariableAggregation.NONE)


        @tf.function
        def step():
            context = tf.distribute.get_replica_context()
            v.assign(tf.cast(context.replica_id_in_sync_group, tf.float32))  # 0 and 1
            tfdist.averaging.average(tfdist.comm.ReplicaCommunicator(strategy), [v])


        strategy.run(step)
        assert [float(c) for c in v.values] == [0.5, 0.5]
        ```
    """
    values = [tf.convert_to_tensor(v) for v in variables]
    means = (comm.all_reduce(values, op="mean") if group_size is None
             else comm.group_all_reduce(values, group_size, op="mean"))
    n_outer = len(anchors) if outer is not None else 0
    for i, (var, mean) in enumerate(zip(variables, means)):
        if i < n_outer:
            assert outer is not None
            mean, anchor, buffer = outer.update(values[i], tf.cast(mean, values[i].dtype),
                                                anchors[i], buffers[i], comm.world_size, first)
            anchors[i].assign(anchor)
            buffers[i].assign(buffer)
        var.assign(mean)


def gossip(comm: Communicator, variables: Sequence) -> None:
    """One decentralized round (BAGUA-style ring gossip): each replica replaces each variable by
    the mean of its own and its two ring neighbours' copies (of the one other copy when there are
    two replicas). The copies travel by all-gather, whose bytes are what is counted: (N - 1) x the
    variable's size per replica.

    Example:
        ```python
        strategy = tf.distribute.MirroredStrategy(tfdist.devices.local_devices(2))
        with strategy.scope():
            v = tf.Variable(0.0, aggregation=tf.VariableAggregation.NONE)


        @tf.function
        def step():
            context = tf.distribute.get_replica_context()
            v.assign(tf.cast(context.replica_id_in_sync_group, tf.float32))
            tfdist.averaging.gossip(tfdist.comm.ReplicaCommunicator(strategy), [v])  # with neighbours


        strategy.run(step)
        print([float(c) for c in v.values])
        ```
    """
    n = comm.world_size
    rank = tf.cast(comm.rank, tf.int32)
    for var in variables:
        mine = tf.convert_to_tensor(var)
        copies = comm.all_gather(mine[None])
        if n == 2:
            mixed = tf.reduce_mean(copies, axis=0)
        else:
            left, right = tf.gather(copies, (rank - 1) % n), tf.gather(copies, (rank + 1) % n)
            mixed = (left + mine + right) / 3.0
        var.assign(mixed)


def optimizer_slots(optimizer, exclude=()) -> list:
    """The optimizer's per-variable state (momentum, Adam moments): its floating-point
    variables other than the learning rate and the variables in `exclude`.

    Example:
        ```python
        model = build_model()
        adam = keras.optimizers.Adam()
        adam.build(model.trainable_variables)
        print(len(tfdist.averaging.optimizer_slots(adam)))  # 2 moments x 2 variables = 4
        ```
    """
    skip = {id(getattr(v, "value", v)) for v in exclude}
    return [v for v in optimizer.variables
            if v.dtype in ("float16", "bfloat16", "float32", "float64")
            and v.name != "learning_rate" and id(getattr(v, "value", v)) not in skip]
