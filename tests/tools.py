"""The project's command-line tools (``tools/*.py``), loaded as modules for tests that call
their functions."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.torchrun import REPO

TOOLS = REPO / "tools"


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as the module ``name``, once per session. It is registered in
    ``sys.modules`` (dataclasses resolve their string annotations through it), and ``tools/`` is
    on ``sys.path`` (a tool imports its sibling modules by name, as when it runs as a script)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(TOOLS) not in sys.path:
        sys.path.append(str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
