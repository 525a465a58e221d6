"""The house rule of issue 18, pinned: `kai_fractions/kube/` is the one way to the Kubernetes
API. Only it imports the HTTP library (aiohttp) and the official client; the simulators the demo
ships (`sim/`, and the demo's stand-ins for the kubelet, the scheduler and the user in `demo/`)
may act through the official client, as kubectl would. No other module has a list + watch loop
or a Kubernetes error class of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import kai_fractions

PACKAGE = Path(kai_fractions.__file__).parent
HTTP = {"aiohttp", "yarl", "multidict", "urllib3", "httpx", "requests"}
CLIENT = {"kubernetes"}
SIMULATORS = ("sim/", "demo/")


def _runtime_imports(path: Path) -> set[str]:
    """Top-level package names imported when the module runs (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) == "TYPE_CHECKING"
                   for node in ast.walk(block)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _modules() -> list[tuple[str, Path]]:
    return [(str(path.relative_to(PACKAGE)), path) for path in sorted(PACKAGE.rglob("*.py"))]


def test_only_kube_speaks_http_to_the_api_server():
    offenders = {name: sorted(_runtime_imports(path) & HTTP) for name, path in _modules()
                 if not name.startswith("kube/") and _runtime_imports(path) & HTTP}
    assert offenders == {}


def test_only_kube_and_the_simulators_use_the_official_client():
    offenders = [name for name, path in _modules()
                 if not name.startswith(("kube/", *SIMULATORS))
                 and _runtime_imports(path) & CLIENT]
    assert offenders == []


def test_one_list_watch_loop_and_one_kubernetes_error_tree():
    loops, errors = [], []
    for name, path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.name == "list_watch":
                loops.append(name)
            if isinstance(node, ast.ClassDef) and node.name in ("KubeError", "ApiException",
                                                                  "Gone", "Transient"):
                errors.append(f"{name}:{node.name}")
    assert loops == ["kube/listwatch.py"]
    assert sorted(errors) == ["kube/errors.py:Gone", "kube/errors.py:KubeError",
                              "kube/errors.py:Transient"]
