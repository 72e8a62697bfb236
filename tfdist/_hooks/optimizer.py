"""Every private Keras optimizer hook tfdist relies on, in one place.

Each hook names the private attribute it touches and is covered by tests/test_hooks.py, which
fails loudly if a TensorFlow or Keras upgrade moves it. Pinned: tensorflow 2.21.x, keras 3.15.x.

* `disable_gradient_all_reduce`: Keras' TF backend all-reduces gradients in
  `TFOptimizer._all_reduce_sum_gradients`, called from `_backend_update_step`
  (keras/src/backend/tensorflow/optimizer.py); tfdist wrappers reduce themselves.
* `install_strategy_hooks`: Keras' TF optimizer class gains, once, a `build` that lets a tfdist
  strategy attach its parts to the user's own optimizer, an `_backend_update_step` that
  hands them the gradients, and `save_own_variables` / `load_own_variables` that save every
  replica's copy of their per-replica state as the tfdist wrapper does; optimizers under any
  other strategy take the original path.
* `variable_index`: the optimizer's index of a variable (`_get_variable_index`), which keys
  per-variable state; `count_apply`: a wrapper's own apply counter (`_iterations`);
  `built_variables`: the trainable variables an optimizer was built for (`_trainable_variables`,
  what `apply(grads)` with no variables updates); `own_variables`: the variables a wrapper
  created itself (`_variables`; its `variables` adds the inner optimizer's);
  `excludes_from_weight_decay`: whether
  `exclude_from_weight_decay` excluded anything (`_exclude_from_weight_decay*`).
* `replace_method`: sets an attribute on an instance past Keras' attribute tracking (ZeroOptimizer
  reroutes its inner optimizer's checkpoint methods; the pipeline places slots).
* `place_on_variable_devices`: slots, updates and weight decay (`_apply_weight_decay`) on each
  variable's device, for pipeline stages on other devices and hosts.
* `fuse_update_step`: SGD updates each variable in one TensorFlow kernel; reads its slots
  (`SGD.momentums`) by `_get_variable_index`.
  `compile_update_step`: any optimizer's own `update_step` of all a device's variables in one
  XLA-compiled function, in place of `_distributed_tf_update_step`'s per-variable loop.
"""

from __future__ import annotations

import types
from typing import Any

import keras
import tensorflow as tf

ALL_REDUCE_HOOK = "_all_reduce_sum_gradients"
UPDATE_HOOK = "_backend_update_step"
ATTACHMENT_ATTRIBUTE = "_tfdist_attachment"  # what a tfdist strategy attached to an optimizer
SKIP_ATTRIBUTE = "_tfdist_no_exchange"  # set on tfdist wrappers and their inner optimizers
_installed: dict[str, Any] = {}


def _device(variable) -> str:
    """A Keras variable's or a tf.Variable's device."""
    return (variable.value if isinstance(variable, keras.Variable) else variable).device


def replace_method(obj, name: str, value) -> None:
    """Sets `obj.name = value` without Keras tracking the value (a bound method, a flag, or a
    variable that is another object's, e.g. ZeRO stage 3's parameter shard)."""
    object.__setattr__(obj, name, value)


def disable_gradient_all_reduce(optimizer) -> None:
    """Makes a Keras optimizer apply the gradients it is given without all-reducing them, and
    keeps tfdist strategies from attaching to it (its wrapper reduces)."""
    if not hasattr(type(optimizer), ALL_REDUCE_HOOK):
        raise RuntimeError(
            f"{type(optimizer).__name__} has no `{ALL_REDUCE_HOOK}`: this Keras version is not "
            "supported by tfdist (pin keras 3.15.x)."
        )

    def _identity(self, grads_and_vars):
        return list(grads_and_vars)

    replace_method(optimizer, ALL_REDUCE_HOOK, types.MethodType(_identity, optimizer))
    replace_method(optimizer, SKIP_ATTRIBUTE, True)


def count_apply(optimizer) -> None:
    """Adds one to the optimizer's own `_iterations` (a wrapper's `iterations` property returns
    its inner optimizer's step, which the inner optimizer counts itself)."""
    optimizer._iterations.assign_add(1)


def built_variables(optimizer) -> list:
    """The trainable variables `optimizer` was built for, in its order (what Keras' `apply(grads)`
    with no variables updates); empty before `build`."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def own_variables(optimizer) -> list:
    """The variables `optimizer` created itself, in creation order (a `LossScaleOptimizer`'s
    `variables` also lists its inner optimizer's)."""
    return list(optimizer._variables)


def excludes_from_weight_decay(optimizer) -> bool:
    """Whether `optimizer.exclude_from_weight_decay` excluded any variable or name pattern."""
    return bool(getattr(optimizer, "_exclude_from_weight_decay", None)) or \
        getattr(optimizer, "_exclude_from_weight_decay_pattern", None) is not None


def variable_index(optimizer, variable) -> int:
    """The index of `variable` in `optimizer`'s trainable variables (Keras' own lookup)."""
    return optimizer._get_variable_index(variable)


def _tf_optimizer_class():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def original_update_step():
    """Keras' own `_backend_update_step` (also after `install_strategy_hooks`)."""
    return _installed.get("original_update") or getattr(_tf_optimizer_class(), UPDATE_HOOK)


def attachment(optimizer):
    """What a tfdist strategy attached to `optimizer` when it was built, or None."""
    return getattr(optimizer, ATTACHMENT_ATTRIBUTE, None)


def install_strategy_hooks() -> None:
    """Idempotently installs the two class hooks described in the module docstring.

    A strategy takes part by defining `tfdist_attach(optimizer, variables)`, returning an object
    with `update(grads, variables, apply)`, `save_replicas(variables, store)`,
    `own_values(store)` and `load_replicas(variables, store)` (a `tfdist.optimizers.Chain`);
    `apply(grads)` is Keras' own per-variable update (no all-reduce), to be called with the
    reduced gradients.
    """
    if _installed:
        return
    import keras

    cls = _tf_optimizer_class()
    if not hasattr(cls, UPDATE_HOOK) or "build" in vars(cls):
        raise RuntimeError(
            "Keras' TF optimizer no longer matches what tfdist hooks (pin keras 3.15.x).")
    original_update = getattr(cls, UPDATE_HOOK)

    def build(self, variables):
        super(cls, self).build(variables)
        attach = getattr(self._distribution_strategy, "tfdist_attach", None)
        skip = getattr(self, SKIP_ATTRIBUTE, False) or isinstance(
            self, keras.optimizers.LossScaleOptimizer)
        if attach is not None and not skip and attachment(self) is None:
            replace_method(self, ATTACHMENT_ATTRIBUTE, attach(self, variables))

    def update_step(self, grads, trainable_variables, learning_rate):
        attached = attachment(self)
        if attached is None:
            return original_update(self, grads, trainable_variables, learning_rate)
        strategy = self._distribution_strategy
        variables = [v.value if isinstance(v, keras.Variable) else v for v in trainable_variables]

        def apply(reduced):
            tf.__internal__.distribute.interim.maybe_merge_call(
                self._distributed_tf_update_step, strategy,
                [(g, v) for g, v in zip(reduced, variables) if g is not None], learning_rate)

        attached.update(list(grads), variables, apply)

    original_save, original_load = cls.save_own_variables, cls.load_own_variables

    def save_own_variables(self, store):
        original_save(self, store)
        attached = attachment(self)
        if attached is not None:
            attached.save_replicas(self.variables, store)

    def load_own_variables(self, store):
        attached = attachment(self)
        if attached is None:
            return original_load(self, store)
        original_load(self, attached.own_values(store))
        attached.load_replicas(self.variables, store)

    cls.build = build
    setattr(cls, UPDATE_HOOK, update_step)
    cls.save_own_variables, cls.load_own_variables = save_own_variables, load_own_variables
    _installed.update(original_update=original_update)


def place_on_variable_devices(optimizer) -> None:
    """Makes `optimizer` create each slot on its variable's device and run each variable's
    update (and weight decay) there. Outside a strategy Keras puts every slot on the default
    device, and the update's arithmetic too: with a variable on another host, its gradient would
    travel to the default device and the new value back, every step.

    Replaces, on the instance: `add_variable_from_reference` and `update_step` (public: Keras'
    per-variable update); `_apply_weight_decay` (private: the TF backend's decay of all
    variables, keras/src/backend/tensorflow/optimizer.py), which then runs once per device; and,
    outside any strategy, `_all_reduce_sum_gradients` (`ALL_REDUCE_HOOK`), whose one-replica
    "all-reduce" is an identity of every gradient on the default device."""
    if getattr(optimizer, "_tfdist_places_slots", False):
        return
    create = optimizer.add_variable_from_reference
    update = optimizer.update_step
    decay = optimizer._apply_weight_decay
    reduce = getattr(optimizer, ALL_REDUCE_HOOK)

    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        with tf.device(_device(reference_variable)):
            return create(reference_variable, name=name, initializer=initializer)

    def update_step(gradient, variable, learning_rate):
        with tf.device(_device(variable)):
            return update(gradient, variable, learning_rate)

    def apply_weight_decay(variables):
        by_device: dict[str, list] = {}
        for variable in variables:
            by_device.setdefault(_device(variable), []).append(variable)
        for device, group in by_device.items():
            with tf.device(device):
                decay(group)

    def all_reduce_sum_gradients(grads_and_vars):
        if tf.distribute.has_strategy():
            return reduce(grads_and_vars)
        return grads_and_vars  # one replica: nothing to sum, nothing to move

    replace_method(optimizer, "add_variable_from_reference", add_variable_from_reference)
    replace_method(optimizer, "update_step", update_step)
    replace_method(optimizer, ALL_REDUCE_HOOK, all_reduce_sum_gradients)
    replace_method(optimizer, "_apply_weight_decay", apply_weight_decay)
    replace_method(optimizer, "_tfdist_places_slots", True)


def _fusable(optimizer) -> str | None:
    """How `fuse_update` with True fuses `optimizer`'s update: "compile" (Adam and AdamW: their
    own arithmetic compiled by XLA), "sgd" or "momentum" (SGD: its kernel), or None."""
    if type(optimizer) in (keras.optimizers.Adam, keras.optimizers.AdamW):
        return "compile"
    if type(optimizer) is keras.optimizers.SGD and isinstance(optimizer.momentum, (int, float)):
        return "sgd" if optimizer.momentum == 0 else "momentum"
    return None


def is_fused(optimizer) -> bool | str:
    """How `optimizer`'s update was fused: True, by a kernel (`fuse_update_step`); "xla",
    compiled (`compile_update_step`); False, not at all."""
    return getattr(optimizer, "_tfdist_fused", False)


def fuse_update(optimizer, kind: bool | str) -> None:
    """Fuses `optimizer`'s update as `kind` says. True: Adam and AdamW compiled by XLA
    (`compile_update_step`: Keras' arithmetic, to float32 rounding), SGD by its kernel
    (`fuse_update_step`: Keras' to the bit), any other optimizer left as it is; "xla": any
    optimizer compiled; False: Keras' own."""
    if kind == "xla" or (kind and _fusable(optimizer) == "compile"):
        compile_update_step(optimizer)
    elif kind:
        fuse_update_step(optimizer)


def fuse_like(source, target) -> None:
    """Fuses `target`'s update as `source`'s is (kernels, XLA or not at all)."""
    fuse_update(target, is_fused(source))


def compile_update_step(optimizer) -> bool:
    """Makes `optimizer` (any Keras optimizer) run its own `update_step` of all the variables
    of a device in one XLA-compiled function (`tf.function(jit_compile=True)`, built the first
    time those variables are updated): Keras' arithmetic, which XLA fuses into one pass over
    each variable with no launch per op. Results differ from Keras' only where XLA contracts a
    multiply and an add into one rounding. Sparse gradients (`IndexedSlices`) keep Keras'
    update.

    Replaces, on the instance, `_distributed_tf_update_step` (private: the TF backend's loop of
    `distribution.extended.update` over the variables, keras/src/backend/tensorflow/
    optimizer.py) with one `extended.update` whose function updates every variable of the
    replica (a strategy's variable resolves to the replica's copy there). `update_step` is read
    when a function is traced, so `place_on_variable_devices` may wrap it before or after."""
    if is_fused(optimizer):
        return True
    keras_loop = optimizer._distributed_tf_update_step
    compiled: dict[tuple, Any] = {}  # (device, variable ids) -> the step closing over them

    def compile_for(variables):
        @tf.function(jit_compile=True, autograph=False)
        def step(gradients, learning_rate):
            for gradient, variable in zip(gradients, variables):
                optimizer.update_step(gradient, variable, learning_rate)
        return step

    def update_on_devices(gradients, variables, learning_rate):
        groups: dict[str, list[int]] = {}
        for i, variable in enumerate(variables):
            groups.setdefault(_device(variable), []).append(i)
        for device, members in groups.items():
            key = (device, *(id(variables[i]) for i in members))
            if key not in compiled:
                compiled[key] = compile_for([variables[i] for i in members])
            with tf.device(device):
                compiled[key]([tf.convert_to_tensor(gradients[i]) for i in members],
                              tf.convert_to_tensor(learning_rate))

    def distributed_update_step(distribution, grads_and_vars, learning_rate):
        dense = [(g, v) for g, v in grads_and_vars if not isinstance(g, tf.IndexedSlices)]
        sparse = [(g, v) for g, v in grads_and_vars if isinstance(g, tf.IndexedSlices)]
        if sparse:
            keras_loop(distribution, sparse, learning_rate)
        if not dense:
            return
        gradients, variables = [g for g, _ in dense], [v for _, v in dense]
        if not tf.distribute.has_strategy():  # one copy of each variable, wherever it is
            return update_on_devices(gradients, variables, learning_rate)
        distribution.extended.update(  # once per replica, with the replica's gradients
            variables[0], lambda _, gradients: update_on_devices(
                gradients, variables, learning_rate), args=(gradients,), group=False)

    replace_method(optimizer, "_distributed_tf_update_step", distributed_update_step)
    replace_method(optimizer, "_tfdist_fused", "xla")
    return True


def fuse_update_step(optimizer) -> bool:
    """Makes an `SGD` optimizer update each variable in one TensorFlow kernel
    (`ResourceApplyKerasMomentum`, or `ResourceApplyGradientDescent` without momentum): Keras'
    arithmetic to the bit, in one pass over the variable instead of a few ops. Sparse gradients
    (`IndexedSlices`) and any other optimizer keep Keras' update. Returns whether the update was
    fused. Replaces `update_step` on the instance (public: Keras' per-variable update), which
    `place_on_variable_devices` may wrap afterwards."""
    kind = _fusable(optimizer)
    if kind not in ("sgd", "momentum") or is_fused(optimizer):
        return kind in ("sgd", "momentum")
    keras_step = optimizer.update_step

    def update_step(gradient, variable, learning_rate):
        if isinstance(gradient, tf.IndexedSlices):
            return keras_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        lr = tf.cast(learning_rate, dtype)
        gradient = tf.cast(gradient, dtype)
        if kind == "momentum":
            accumulator = optimizer.momentums[variable_index(optimizer, variable)].handle
            tf.raw_ops.ResourceApplyKerasMomentum(
                var=variable.handle, accum=accumulator, lr=lr, grad=gradient,
                momentum=tf.constant(optimizer.momentum, dtype),
                use_nesterov=bool(optimizer.nesterov))
        else:
            tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=lr, delta=gradient)

    replace_method(optimizer, "update_step", update_step)
    replace_method(optimizer, "_tfdist_fused", True)
    return True
