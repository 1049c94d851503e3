"""A registry of pluggable parts (models, attention backends, tool-call parsers, grammar
backends), each imported from its module on first use.

A registry is made with its table of names, `{name: module}`: the one place a name is
declared. Listing the names imports nothing. The module a name points to defines one factory
(a class, usually) and registers it with the `@registry.register` decorator, which returns it
unchanged; every name that points to that module then means that factory.

    BACKENDS = Registry("attention_backend", {"triton": "braid.runtime.attention.triton_backend"})

    @BACKENDS.register            # in braid/runtime/attention/triton_backend.py
    class TritonBackend(AttentionBackend): ...

    BACKENDS.get("triton")        # imports triton_backend on first use; TritonBackend
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names of one kind of part, declared once in `modules`, and the factories their modules
    register.

    `kind` names the setting the names are given in (`attention_backend`, ...); `unknown` is
    the message of the `ValueError` an unknown name raises, formatted with `name`, `kind` and
    `known` (the sorted list of names).
    """

    def __init__(
        self,
        kind: str,
        modules: Mapping[str, str],
        *,
        unknown: str = "{kind} {name!r} is unknown (have {known})",
    ) -> None:
        self.kind = kind
        self._modules = dict(modules)
        self._unknown = unknown
        self._factories: dict[str, T] = {}  # module -> the factory it registered
        self._lock = threading.Lock()

    def register(self, factory: T) -> T:
        """Decorator: registers `factory` for every name whose module is the one defining it,
        and returns it. `ValueError` if no name points to that module (declare the names in
        the table first), or if the module already registered another factory."""
        module = factory.__module__
        if module not in self._modules.values():
            raise ValueError(
                f"{module} is not in the {self.kind} table: declare its names there first"
            )
        with self._lock:
            held = self._factories.get(module)
            if held is not None and held.__qualname__ != factory.__qualname__:
                raise ValueError(
                    f"{module} registers two {self.kind} factories: "
                    f"{held.__qualname__} and {factory.__qualname__}"
                )
            self._factories[module] = factory
        return factory

    def names(self) -> list[str]:
        """Every declared name, sorted; imports no module."""
        return sorted(self._modules)

    def __contains__(self, name: object) -> bool:
        return name in self._modules

    def get(self, name: str) -> T:
        """The factory for `name`, importing its module on first use; `ValueError` (the
        registry's `unknown` message, listing the known names) if `name` is not declared."""
        module = self._modules.get(name)
        if module is None:
            raise ValueError(self._unknown.format(kind=self.kind, name=name, known=self.names()))
        factory = self._factories.get(module)
        if factory is None:
            importlib.import_module(module)
            factory = self._factories.get(module)
            if factory is None:
                raise RuntimeError(
                    f"{module} was imported for {self.kind} {name!r} but registered nothing "
                    "(decorate its factory with @register)"
                )
        return factory
