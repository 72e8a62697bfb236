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
* `fuse_update_step`: Adam/AdamW and SGD update each variable in one TensorFlow kernel; reads
  their slots (`Adam._momentums`, `Adam._velocities`, `SGD.momentums`) by `_get_variable_index`.
  `compile_update_step`: any optimizer's own `update_step`, one XLA-compiled function per
  variable.
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
    """Which fused kernel applies Keras' own update of `optimizer`, or None."""
    numbers = (int, float)
    if type(optimizer) in (keras.optimizers.Adam, keras.optimizers.AdamW):
        if optimizer.amsgrad or not all(isinstance(getattr(optimizer, name), numbers)
                                        for name in ("beta_1", "beta_2", "epsilon")):
            return None
        return "adam"
    if type(optimizer) is keras.optimizers.SGD and isinstance(optimizer.momentum, numbers):
        return "sgd" if optimizer.momentum == 0 else "momentum"
    return None


def is_fused(optimizer) -> bool | str:
    """Whether `fuse_update_step` fused `optimizer`'s update: True, "xla" when
    `compile_update_step` compiled it, False otherwise."""
    return getattr(optimizer, "_tfdist_fused", False)


def fuse_update(optimizer, kind: bool | str) -> None:
    """Fuses `optimizer`'s update as `kind` says: True, one kernel where one exists
    (`fuse_update_step`); "xla", compiled (`compile_update_step`); False, Keras' own."""
    if kind == "xla":
        compile_update_step(optimizer)
    elif kind:
        fuse_update_step(optimizer)


def fuse_like(source, target) -> None:
    """Fuses `target`'s update as `source`'s is (kernels, XLA or not at all)."""
    fuse_update(target, is_fused(source))


def compile_update_step(optimizer) -> bool:
    """Makes `optimizer` (any Keras optimizer) run its own `update_step` of each variable as
    one XLA-compiled function (`tf.function(jit_compile=True)`, built the first time the
    variable is updated): Keras' arithmetic, which XLA fuses into one pass over the variable;
    its results differ from Keras' only where XLA contracts a multiply and an add into one
    rounding. Sparse gradients (`IndexedSlices`) keep Keras' update. Replaces `update_step` on
    the instance, as `fuse_update_step` does."""
    if is_fused(optimizer):
        return True
    keras_step = optimizer.update_step
    compiled: dict[int, Any] = {}  # id(variable) -> its step, whose closure holds the variable

    def compile_for(variable):
        @tf.function(jit_compile=True, autograph=False)
        def step(gradient, learning_rate):
            keras_step(gradient, variable, learning_rate)
        return step

    def update_step(gradient, variable, learning_rate):
        if isinstance(gradient, tf.IndexedSlices):
            return keras_step(gradient, variable, learning_rate)
        if id(variable) not in compiled:
            compiled[id(variable)] = compile_for(variable)
        compiled[id(variable)](tf.convert_to_tensor(gradient),
                               tf.convert_to_tensor(learning_rate))

    replace_method(optimizer, "update_step", update_step)
    replace_method(optimizer, "_tfdist_fused", "xla")
    return True


def fuse_update_step(optimizer) -> bool:
    """Makes `optimizer` (Adam or AdamW without amsgrad, or SGD) update each variable in one
    TensorFlow kernel (`ResourceApplyAdam`, `ResourceApplyKerasMomentum`,
    `ResourceApplyGradientDescent`), the same arithmetic as Keras' `update_step` in one pass
    over the variable instead of about ten ops. Sparse gradients (`IndexedSlices`) and any other
    optimizer keep Keras' update. Returns whether the update was fused. Replaces `update_step`
    on the instance (public: Keras' per-variable update), which `place_on_variable_devices`
    may wrap afterwards."""
    kind = _fusable(optimizer)
    if kind is None or is_fused(optimizer):
        return kind is not None
    keras_step = optimizer.update_step

    def slot(slots, variable):
        return slots[variable_index(optimizer, variable)].handle

    def update_step(gradient, variable, learning_rate):
        if isinstance(gradient, tf.IndexedSlices):
            return keras_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        lr = tf.cast(learning_rate, dtype)
        gradient = tf.cast(gradient, dtype)
        if kind == "adam":
            local_step = tf.cast(optimizer.iterations + 1, dtype)
            beta_1 = tf.constant(optimizer.beta_1, dtype)
            beta_2 = tf.constant(optimizer.beta_2, dtype)
            tf.raw_ops.ResourceApplyAdam(
                var=variable.handle, m=slot(optimizer._momentums, variable),
                v=slot(optimizer._velocities, variable),
                beta1_power=tf.pow(beta_1, local_step), beta2_power=tf.pow(beta_2, local_step),
                lr=lr, beta1=beta_1, beta2=beta_2,
                epsilon=tf.constant(optimizer.epsilon, dtype), grad=gradient)
        elif kind == "momentum":
            tf.raw_ops.ResourceApplyKerasMomentum(
                var=variable.handle, accum=slot(optimizer.momentums, variable), lr=lr,
                grad=gradient, momentum=tf.constant(optimizer.momentum, dtype),
                use_nesterov=bool(optimizer.nesterov))
        else:
            tf.raw_ops.ResourceApplyGradientDescent(var=variable.handle, alpha=lr, delta=gradient)

    replace_method(optimizer, "update_step", update_step)
    replace_method(optimizer, "_tfdist_fused", True)
    return True
