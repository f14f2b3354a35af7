"""The package's structure, read from its source: layers import one way (docs/architecture.md,
"Layers"), no import cycle, no module over 400 lines, the engine imports no tool (``tools/``) or tool
dependency, and no policy name is tested outside ``nanovllm/sparse/``."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanovllm"

LAYERS = [  # top to bottom: a module may import its own layer's modules and the layers below
    ["nanovllm.integrations"],
    ["nanovllm", "nanovllm.llm"],
    ["nanovllm.engine"],
    ["nanovllm.models"],
    ["nanovllm.layers"],
    ["nanovllm.kvcache"],
    ["nanovllm.config"],
    ["nanovllm.sparse"],
    ["nanovllm.ops"],
    ["nanovllm.parallel"],
    ["nanovllm.sequence", "nanovllm.sampling_params", "nanovllm.outputs", "nanovllm.inputs", "nanovllm.hub",
     "nanovllm.vllm_compat", "nanovllm.fetch", "nanovllm.gguf_convert", "nanovllm.utils"],
]
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path) -> set[str]:
    """The nanovllm modules ``name`` imports anywhere in its source (functions too), resolved:
    ``from package import submodule`` is an import of the submodule (``from nanovllm import _sgdma``,
    a compiled extension, none)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found, known = set(), modules()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = [f"{base}.{alias.name}" for alias in node.names]
            found.update(subs)
            if not all(sub in known or alias.name.startswith("_") for sub, alias in zip(subs, node.names)):
                found.add(base)
    return {m for m in found if m in known and m != name}


def layer_of(name: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    assert best is not None, f"{name} is in no layer of tests/test_architecture.py::LAYERS"
    return best[0]


def test_every_module_imports_only_its_layer_and_below():
    upward = [f"{name} (layer {layer_of(name)}) imports {dep} (layer {layer_of(dep)})"
              for name, path in modules().items() for dep in sorted(imports(name, path))
              if layer_of(dep) < layer_of(name)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = {name: imports(name, path) for name, path in modules().items()}
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_module_over_400_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_engine_imports_no_tool_dependency_and_holds_no_tool():
    code = "import sys, nanovllm; print(sorted({m.split('.')[0] for m in sys.modules} & {'gguf', 'accelerate'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.strip()
    assert out == "[]", f"import nanovllm imported {out}"
    tools = [name for name in modules() if any(word in name for word in ("ruler", "passkey", "random_checkpoint",
                                                                         "divergence"))]
    assert not tools, f"evaluation tools inside the engine package: {tools}"


def test_the_engine_never_imports_the_tools_folder():
    """``tools/`` (imported as ``tools`` from the repo root) is not installed with the engine, so no
    module of ``nanovllm/`` may import it, not even inside a function."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                       [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{name}:{node.lineno}: {t}" for t in targets if t == "tools" or t.startswith("tools.")]
    assert not found, "nanovllm/ imports tools/:\n" + "\n".join(found)


def test_no_policy_name_is_tested_outside_sparse():
    from nanovllm.sparse import policy_names

    names = {name.upper() for name in policy_names()}
    found = []
    for name, path in modules().items():
        if name.startswith("nanovllm.sparse"):
            continue
        tree = ast.parse(path.read_text())
        compared = [c for node in ast.walk(tree) if isinstance(node, ast.Compare)
                    for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        found += [f"{name}:{c.lineno}: {c.value!r}" for c in compared if c.value.upper() in names]
    assert not found, "policy names outside nanovllm/sparse/ (judge a policy by its declarations):\n" + "\n".join(found)


@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_every_layer_has_a_module(layer):
    assert any(layer_of(name) == layer for name in modules()) or LAYERS[layer] == ["nanovllm.integrations"]
