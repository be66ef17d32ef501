"""Imports point down only (docs/architecture.md): config <- formats <- kernels <- model <- parallel <- engine
<- serve, config <- text <- serve; checkpoints may import config, formats and text. transformers
is a test dependency only and never imported from src/; only kernels/triton/ imports triton
(docs/kernels.md §1)."""

from __future__ import annotations

import ast
from pathlib import Path

import m2serve

SRC = Path(m2serve.__file__).parent
CHAIN = ["config", "formats", "kernels", "model", "parallel", "engine"]
ALLOWED = {layer: set(CHAIN[: i + 1]) for i, layer in enumerate(CHAIN)}
ALLOWED["text"] = {"config", "text"}
ALLOWED["checkpoints"] = {"config", "formats", "text", "checkpoints"}
ALLOWED["serve"] = set(CHAIN) | {"text", "checkpoints", "serve"}
FORBIDDEN = {"transformers"}


def _imports(path: Path, root: Path | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path`` (under ``root``, default the package);
    relative imports resolved."""
    package = ".".join(("m2serve", *path.relative_to(root or SRC).with_suffix("").parts))
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            if mod == "m2serve":  # from m2serve import engine
                out.extend((node.lineno, f"{mod}.{a.name}") for a in node.names)
    return out


def violations() -> list[str]:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).parts
        layer = parts[0] if len(parts) > 1 else None  # top-level modules may import anything
        for line, mod in _imports(path):
            top = mod.split(".")
            if top[0] in FORBIDDEN:
                bad.append(f"{path.relative_to(SRC)}:{line} imports {mod} (test-only dependency)")
            if layer and top[0] == "m2serve" and len(top) > 1 and top[1] in ALLOWED:
                if top[1] not in ALLOWED.get(layer, {layer}):
                    bad.append(f"{path.relative_to(SRC)}:{line} ({layer}) imports {mod} ({top[1]})")
    return bad


def test_imports_point_down_only():
    assert violations() == []


TRITON_HOME = ("kernels", "triton")  # docs/kernels.md §1: imported only when a Triton path is chosen


def triton_importers(root: Path | None = None) -> list[str]:
    """Modules outside kernels/triton/ that import ``triton`` or m2serve.kernels.triton."""
    root = root or SRC
    bad = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[:2] == TRITON_HOME:
            continue
        for line, mod in _imports(path, root):
            if mod.split(".")[0] == "triton" or mod.startswith("m2serve.kernels.triton"):
                bad.append(f"{path.relative_to(root)}:{line} imports {mod}")
    return bad


def test_only_the_triton_package_imports_triton(tmp_path):
    assert triton_importers() == []
    # and the walker can fail: the model importing the kernel package, the kernels importing triton
    (tmp_path / "model").mkdir()
    (tmp_path / "kernels" / "triton").mkdir(parents=True)
    (tmp_path / "model" / "x.py").write_text("from m2serve.kernels.triton import attention\n")
    (tmp_path / "kernels" / "ops.py").write_text("import triton.language as tl\n")
    (tmp_path / "kernels" / "triton" / "k.py").write_text("import triton\n")
    assert triton_importers(tmp_path) == ["kernels/ops.py:1 imports triton.language",
                                          "model/x.py:1 imports m2serve.kernels.triton"]


def test_checker_catches_an_upward_import(tmp_path, monkeypatch):
    # the walker must be able to fail: a fake tree with model importing engine and transformers
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "x.py").write_text("from m2serve.engine import core\nimport transformers\n"
                                             "from ..serve import api\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    (tmp_path / "model" / "y.py").write_text("from m2serve import serve\nfrom m2serve.config import x\n")
    found = violations()
    assert len(found) == 4, found
    assert "imports m2serve.engine" in found[0] and "transformers" in found[1]
    assert "m2serve.serve" in found[2] and "y.py:1" in found[3]
