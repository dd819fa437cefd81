"""docs/CLI.md and docs/API.md are generated (scripts/gen_docs.py: the argparse parsers of
``weight-transfer`` and the public API's docstrings); the committed files must equal the
script's output, so a changed option or docstring shows up in the docs in the same commit."""
from __future__ import annotations

import importlib.util

import pytest

from tests.helpers import ROOT


def _gen():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = _gen()


@pytest.mark.parametrize("rel", sorted(GEN.OUTPUTS))
def test_generated_doc_is_current(rel):
    committed = (ROOT / rel).read_text()
    if f"(Python {GEN.PYTHON})" not in committed.splitlines()[0]:
        pytest.skip(f"{rel} was rendered by another Python than {GEN.PYTHON} (argparse's layout differs)")
    made = GEN.OUTPUTS[rel]()
    if committed != made:
        a, b = committed.splitlines(), made.splitlines()
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        pytest.fail(f"{rel} is out of date (run python scripts/gen_docs.py); first difference at line "
                    f"{first + 1}:\n committed: {a[first] if first < len(a) else '<end>'}\n"
                    f" generated: {b[first] if first < len(b) else '<end>'}")


def test_the_cli_doc_has_every_subcommand():
    text = (ROOT / "docs" / "CLI.md").read_text()
    for name in GEN._subcommands():
        assert f"## `weight-transfer {name}`" in text, name


def test_the_api_doc_has_every_public_name():
    import weight_transfer

    text = (ROOT / "docs" / "API.md").read_text()
    for name in weight_transfer.__all__:
        assert f"### `weight_transfer.{name}`" in text, name
    _, names = GEN._backend_all()
    for name in names:
        assert f"### `weight_transfer.engines.vllm.backend.plugin.{name}`" in text, name
