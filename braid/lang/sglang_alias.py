"""Run code written for SGLang's frontend unchanged: `install()` makes `import sglang` (and the
submodules SGLang programs import: `sglang.lang.ir`, `sglang.utils`, ...) resolve to braid.

    from braid.lang import sglang_alias
    sglang_alias.install()
    import sglang as sgl            # braid, under SGLang's names

The alias maps module names to braid's own modules (the same objects, so `sglang.lang.ir` and
`braid.lang.ir` are one module, and state such as the default backend is shared); `sglang`
itself is a small module that forwards every name to `braid`. It never shadows a real SGLang
installation: where `sglang` is importable, `install()` refuses. A submodule braid does not
provide fails to import with a message naming it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

# SGLang module name -> braid module name ("" for a package braid has no counterpart of).
# `sglang` itself is a proxy module that forwards to braid (see `install`).
MODULES = {
    "sglang.api": "braid.lang.api",
    "sglang.global_config": "braid.lang.config",
    "sglang.utils": "braid.utils",
    "sglang.lang": "braid.lang",
    "sglang.lang.api": "braid.lang.api",
    "sglang.lang.ir": "braid.lang.ir",
    "sglang.lang.interpreter": "braid.lang.interpreter",
    "sglang.lang.choices": "braid.lang.choices",
    "sglang.lang.tracer": "braid.lang.tracer",
    "sglang.lang.global_config": "braid.lang.config",
    "sglang.lang.backend": "braid.lang.backends",
    "sglang.lang.backend.base_backend": "braid.lang.backends.base",
    "sglang.lang.backend.runtime_endpoint": "braid.lang.backends.endpoint",
    "sglang.lang.backend.openai": "braid.lang.backends.openai",
    "sglang.srt": "",
    "sglang.srt.utils": "",
    "sglang.srt.hf_transformers_utils": "braid.utils",
    "sglang.srt.utils.hf_transformers_utils": "braid.utils",
}
_PACKAGES = {"sglang.lang", "sglang.lang.backend", "sglang.srt", "sglang.srt.utils"}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        if not self.target:
            module = types.ModuleType(spec.name, "a namespace of braid's SGLang alias")
            module.__path__ = []
            return module
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("sglang."):
            return None
        if fullname not in MODULES:
            raise ModuleNotFoundError(
                f"braid's SGLang alias has no module {fullname!r} (it provides: sglang, "
                f"{', '.join(sorted(MODULES))})",
                name=fullname,
            )
        return importlib.machinery.ModuleSpec(
            fullname, _Alias(MODULES[fullname]), is_package=fullname in _PACKAGES
        )


_FINDER = _Finder()


def _proxy() -> types.ModuleType:
    """`sglang`: braid's public names. A separate module, so that importing a submodule
    (`sglang.global_config`) binds it on the proxy, not over `braid.global_config`."""
    import braid

    module = types.ModuleType("sglang", "braid under SGLang's name (braid.lang.sglang_alias)")
    module.__path__ = []
    module.__getattr__ = lambda name: getattr(braid, name)  # PEP 562
    module.__dir__ = lambda: dir(braid)
    return module


def install() -> None:
    """Make `sglang` import as braid (idempotent); `ValueError` if a real SGLang is
    installed."""
    if _FINDER in sys.meta_path:
        return
    if "sglang" not in sys.modules and importlib.util.find_spec("sglang") is not None:
        raise ValueError("sglang is installed here: braid will not shadow it")
    import braid.lang
    from braid.lang.config import global_config

    sys.modules["sglang"] = _proxy()
    sys.meta_path.insert(0, _FINDER)
    # As SGLang's __init__ does: import the config modules, then bind the object over them.
    importlib.import_module("sglang.global_config")
    importlib.import_module("sglang.lang.global_config")
    sys.modules["sglang"].global_config = global_config
    braid.lang.global_config = global_config


def uninstall() -> None:
    """Remove the alias and the aliased module names (braid's modules stay imported)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]
