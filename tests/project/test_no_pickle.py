"""Nothing from the wire runs (issue 54, docs/SECURITY.md): no module of the library, the vLLM
backend, the baselines, the harness or the scripts unpickles what it reads -- no ``pickle.load(s)``,
no ``torch.load`` without ``weights_only=True``, none of torch's object collectives (which
unpickle what another rank sends) -- and the control plane's own values are never pickled."""
import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT

FOLDERS = ("reference", "engines", "baselines", "experiments", "scripts", "examples")
FILES = sorted(p for f in FOLDERS for p in (ROOT / f).rglob("*.py"))
UNPICKLING = {"load", "loads", "Unpickler"}
OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "recv_object_list"}


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield node, owner, name


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_received_is_unpickled(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node, owner, name in _calls(tree):
        where = f"{path.relative_to(ROOT)}:{node.lineno}"
        if owner in ("pickle", "cloudpickle", "dill") and name in UNPICKLING:
            bad.append(f"{where}: {owner}.{name}")
        if owner == "torch" and name == "load":
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords)
            if not safe:
                bad.append(f"{where}: torch.load without weights_only=True")
        if name in OBJECT_COLLECTIVES:
            bad.append(f"{where}: {name} (unpickles what another rank sends)")
    assert not bad, "; ".join(bad)
