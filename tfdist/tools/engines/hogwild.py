"""One process, `engine.devices` replicas updating shared weights without locks."""

from __future__ import annotations

from tfdist.tools.engines.base import register
from tfdist.tools.engines.data_parallel import OneProcess


@register("hogwild")
class Hogwild(OneProcess):
    """One process, `engine.devices` replicas updating shared weights without locks."""

    devices_are_replicas = True
    tfdist_optimizer = False

    def check(self, config):
        comp, opt, train = config["compression"], config["optimizer"], config["train"]
        extras = [name for name, on in (
            ("optimizer.name other than sgd", opt["name"] != "sgd"),
            ("optimizer.momentum", bool(opt["momentum"])),
            ("optimizer.weight_decay", bool(opt["weight_decay"])),
            ("compression.name", comp["name"] != "none" or comp["error_feedback"]),
            ("averaging.period", config["averaging"]["period"] is not None),
            ("optimizer.zero_stage", opt["zero_stage"] is not None),
            ("optimizer.accumulation_steps", opt["accumulation_steps"] > 1),
            ("train.checkpoint_steps", bool(train["checkpoint_steps"])),
            ("train.resize_policy", train["resize_policy"] is not None),
            ("train.precision: mixed_float16", train["precision"] == "mixed_float16")) if on]
        if not extras:
            return []
        return [f"engine.name: 'hogwild' is plain SGD whose replicas update shared weights "
                f"without locks; {', '.join(extras)} do(es) not combine with it: use "
                "optimizer.name sgd with momentum 0 and weight_decay 0, no compression, "
                "averaging, ZeRO, accumulation, checkpoints or resize policy, and float32 or "
                "mixed_bfloat16"]

    def make(self, config):
        from tfdist.comm import DistributeEngine
        from tfdist.devices import local_devices
        from tfdist.ps import HogwildStrategy

        strategy = HogwildStrategy(local_devices(config["engine"]["devices"]))
        return strategy, DistributeEngine(strategy)

    def resume(self, run, model, optimizer, steps):
        """No backups (the replicas' lock-free updates are not reproducible): a notice says in
        one line that nothing is saved."""
        run.backup(one_process=False)
        return 0, []

    def optimizer(self, inner):
        from tfdist.ps import HogwildSGD

        return HogwildSGD(float(inner.learning_rate))

    def compile_options(self):
        return {"jit_compile": False}

    def callbacks(self):
        return []  # the optimizer counts its updates itself

    def report(self, model, optimizer, steps, micro_batch, run_dir):
        """The replicas' updates and their staleness (other replicas' updates before each),
        also written to TensorBoard by the chief."""
        from tfdist.ps.optimizer import write_report
        from tfdist.tools.run_files import TENSORBOARD

        hogwild = optimizer.report()
        if self.is_chief:
            write_report(f"{run_dir}/{TENSORBOARD}/hogwild", hogwild)
        return {**super().report(model, optimizer, steps, micro_batch, run_dir),
                "hogwild": hogwild}
