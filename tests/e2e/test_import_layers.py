"""Imports flow one way through the package's layers (docs/architecture.md):

    core <- backends <- kernels <- resolve <- compiled <- operations <- modules <- distributed
        <- factory <- models <- integrations <- application

A module may import from its own layer and the layers below it, never from a layer above, and
that includes imports inside functions (a lazy import is still a dependency). Every module of
the package must have a layer: a new file fails here until it is placed. Read from the source
with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import REPO

PACKAGE = REPO / "dilated_attention"

#: (layer, module-name prefixes), lowest first; a prefix "x" matches "x" and "x.*".
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("core", "_validation", "_version", "config", "patterns")),
    ("backends", ("backends",)),
    ("kernels", ("block_sparse",)),
    ("resolve", ("resolve",)),
    ("compiled", ("compiled", "pattern_keys", "decode_step")),
    ("operations", ("functional", "sparse")),
    ("modules", ("modules", "rotary")),
    ("distributed", ("distributed",)),
    ("factory", ("factory",)),
    ("models", ("models",)),
    ("integrations", ("integrations",)),
    ("application", ("__init__", "__main__", "demo", "extreme")),
]


def _module_name(path: Path) -> str:
    """``backends/triton.py`` -> ``backends.triton``; ``core/__init__.py`` -> ``core``; the
    package's own ``__init__.py`` -> ``__init__``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise LookupError(module)


def _known(module: str) -> bool:
    """Whether ``module`` names a file of the package (else it is a name inside one)."""
    path = PACKAGE.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module of the package) for every import in ``path`` (or in ``source`` read as
    that file), at any depth."""
    own = _module_name(path)
    if path.name == "__init__.py":
        package = [] if own == "__init__" else own.split(".")
    else:
        package = own.split(".")[:-1]
    found = []
    text = path.read_text() if source is None else source
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "dilated_attention"]
            found += [
                (node.lineno, n.removeprefix("dilated_attention").lstrip(".") or "__init__")
                for n in names
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            elif (node.module or "").split(".")[0] == "dilated_attention":
                base, node_module = [], node.module.removeprefix("dilated_attention").lstrip(".")
                found += [(node.lineno, node_module or "__init__")]
                continue
            else:
                continue
            target = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.append((node.lineno, sub if _known(sub) else target or "__init__"))
    return found


FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: _module_name(p))
def test_every_module_has_a_layer_and_imports_no_layer_above_it(path: Path) -> None:
    own = _module_name(path)
    try:
        own_layer = _layer(own)
    except LookupError:
        pytest.fail(f"{own} has no layer: add it to LAYERS in {Path(__file__).name}")
    above = [
        f"line {line}: {target} ({LAYERS[_layer(target)][0]})"
        for line, target in _imports(path)
        if _layer(target) > own_layer
    ]
    assert not above, f"{own} ({LAYERS[own_layer][0]}) imports from a layer above: {above}"


def test_the_check_sees_lazy_and_relative_imports() -> None:
    """The parser finds imports inside a function and resolves relative ones to modules."""
    source = (
        "def f():\n    from ..factory import create\n    from . import modules\n"
        "    import dilated_attention\n"
    )
    found = _imports(PACKAGE / "distributed" / "not_a_file.py", source)
    assert found == [(2, "factory"), (3, "distributed.modules"), (4, "__init__")]
    assert _layer("factory") > _layer("distributed")
