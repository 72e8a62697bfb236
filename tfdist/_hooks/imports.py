"""Private Keras import hook: matplotlib loaded on first use, not when Keras loads.

Keras imports `matplotlib.pyplot` and `matplotlib.patches` as it loads, for its image galleries
(`keras.src.visualization`), each in a `try: ... except ImportError` that leaves the name None.
Where matplotlib is installed (the `tools` extra), that is about a second of every process's
start-up, for functions training never calls: `import tfdist` took 5.7 s of CPU against 4.5 s
with matplotlib hidden, on the 2-core test machine.

tfdist imports TensorFlow (hence Keras) with matplotlib hidden from those two Keras modules
(from them only), then gives them stand-ins that import matplotlib when first used: the
galleries work as before, and a program that imports matplotlib gets it as usual. A process
that loaded Keras or matplotlib before tfdist is left as it is. Covered by tests/test_hooks.py.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Iterator
from types import FrameType

# Keras module -> (its name for a matplotlib module, that module)
_KERAS_USERS = {
    "keras.src.visualization.plot_image_gallery": ("plt", "matplotlib.pyplot"),
    "keras.src.visualization.plot_bounding_box_gallery": ("patches", "matplotlib.patches"),
}


class _Hidden(importlib.abc.MetaPathFinder):
    """Refuses matplotlib to those Keras modules while installed (their `except ImportError`
    then takes over); any other module importing it meanwhile gets it as usual."""

    def find_spec(self, name, path=None, target=None):
        if (name == "matplotlib" or name.startswith("matplotlib.")) and _keras_user_importing():
            raise ModuleNotFoundError(f"{name} is imported on first use", name=name)
        return None


def _keras_user_importing() -> bool:
    """Whether one of `_KERAS_USERS` is running its imports (a frame of its module body is on
    this thread's stack)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") in _KERAS_USERS:
            return True
        frame = frame.f_back
    return False


class _OnFirstUse:
    """Stands for a module: imports it at the first attribute asked for."""

    def __init__(self, module: str):
        self._module = module

    def __getattr__(self, name: str):
        return getattr(importlib.import_module(self._module), name)

    def __repr__(self) -> str:
        return f"<{self._module}, imported on first use>"


@contextlib.contextmanager
def matplotlib_on_first_use() -> Iterator[None]:
    """Around the block that imports TensorFlow for the first time: Keras loads without
    matplotlib, and its galleries import it when they are called."""
    if ("keras" in sys.modules or "matplotlib" in sys.modules
            or importlib.util.find_spec("matplotlib") is None):
        yield
        return
    hidden = _Hidden()
    sys.meta_path.insert(0, hidden)
    try:
        yield
    finally:
        sys.meta_path.remove(hidden)
        for module, (name, target) in _KERAS_USERS.items():
            loaded = sys.modules.get(module)
            if loaded is not None and getattr(loaded, name, None) is None:
                setattr(loaded, name, _OnFirstUse(target))
