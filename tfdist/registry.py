"""Named classes that configs can refer to: one registry style for compressors
(`tfdist.compression.register`) and local SGD's outer rules (`tfdist.averaging.register`).

A class of your own is one file. Either decorate it, and import its module before the name is
used:

    @tfdist.compression.register("mine")
    class Mine(tfdist.compression.Compressor): ...

or name it by its import path, `module.path:Class`, which needs no registration and works
from a config (`tfdist train --set compression.name=my_codecs:Mine`): the module is imported
(from the working directory, as `python -m` would) and the class registered under that path, so
a saved config or checkpoint names it the same way. An instance of an unregistered class saves
under its import path too (`name_for`).
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_import_path(name: Any) -> bool:
    """Whether `name` reads as `module.path:Class`."""
    return isinstance(name, str) and bool(_PATH.match(name))


class Registry(dict[str, type[T]], Generic[T]):
    """name -> class of one kind (every class a subclass of `base`), filled by `register`."""

    def __init__(self, kind: str, base: type[T]):
        super().__init__()
        self.kind, self.base = kind, base

    def register(self, name: str):
        """Class decorator: makes the class known under `name` (its `registry_name`)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"A {self.kind} needs a non-empty name. Received: {name!r}")

        def add(cls: type[T]) -> type[T]:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"@register({name!r}) decorates a subclass of "
                                f"{self.base.__name__}. Received: {cls!r}")
            cls.registry_name = name  # type: ignore[attr-defined]
            self[name] = cls
            return cls

        return add

    def lookup(self, name: Any) -> type[T]:
        """The class registered as `name`, or the one a `module.path:Class` name imports."""
        if isinstance(name, str) and (name in self or name.lower() in self):
            return self.get(name) or self[name.lower()]
        if is_import_path(name):
            return self._imported(name)
        raise ValueError(f"Unknown {self.kind} {name!r}: use one of {sorted(self)}, or your own "
                         f"{self.base.__name__} subclass as 'module.path:Class'.")

    def name_of(self, cls: type[T]) -> str | None:
        """The name `cls` is registered under, or None."""
        return next((name for name, known in self.items() if known is cls), None)

    def name_for(self, cls: type[T]) -> str | None:
        """The name a config gives `cls`: its registered name, else its import path
        (`module:Class`, registered now), or None for a class that cannot be imported by name
        (defined inside a function or another class)."""
        name = self.name_of(cls)
        path = f"{cls.__module__}:{cls.__qualname__}"
        if name is None and is_import_path(path):
            name = path
            self.register(name)(cls)
        return name

    def _imported(self, path: str) -> type[T]:
        module_name, _, attribute = path.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"{self.kind} {path!r}: cannot import module {module_name!r} ({e}); "
                             "run from the directory that holds it, or add that directory to "
                             "PYTHONPATH.") from e
        cls = getattr(module, attribute, None)
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ValueError(f"{self.kind} {path!r}: {module_name!r} has no {self.base.__name__} "
                             f"subclass named {attribute!r} (found {cls!r:.60}).")
        if self.name_of(cls) is None:
            self.register(path)(cls)
        return cls
