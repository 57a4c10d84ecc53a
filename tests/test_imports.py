"""The package's import structure: no cycles, a transport that knows no codec, a cheap ``import hpcdp``.

The graph is built from the source with ``ast`` (module-level and function-level imports,
relative imports resolved), so an import hidden inside a function counts too.
"""
import ast
import subprocess
import sys
from pathlib import Path

import hpcdp

PACKAGE = Path(hpcdp.__file__).parent
# modules under hpcdp/comm that may import torch: they handle device buffers
COMM_TORCH_ALLOWED = {"hpcdp.comm.buffers", "hpcdp.comm.spaces"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set) -> set:
    """The hpcdp modules (and third-party top-level names) that ``path`` imports."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{target}.{a.name}" for a in node.names} & modules
            found.update(subs or {target})
    return {m if m in modules else m.split(".")[0] for m in found} - {name}


def _graph() -> dict:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    graph = _graph()
    assert "hpcdp.compress.registry" in graph["hpcdp.collectives"]
    assert "torch" in graph["hpcdp.torch.reducer"]


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_transport_imports_no_codec_model_or_trace():
    graph = _graph()
    for module, deps in graph.items():
        if not module.startswith("hpcdp.comm"):
            continue
        bad = {d for d in deps if d.startswith(("hpcdp.compress", "hpcdp.torch", "hpcdp.trace",
                                                 "hpcdp.collectives", "hpcdp._runtime"))}
        assert not bad, f"{module} imports {sorted(bad)}"
        if module not in COMM_TORCH_ALLOWED:
            assert "torch" not in deps, f"{module} imports torch (only device-buffer modules may)"


def test_import_hpcdp_loads_neither_torch_nor_mpi():
    code = ("import sys, hpcdp, hpcdp.compress, hpcdp.info; "
            "print(sorted(m for m in ('torch', 'mpi4py.MPI', 'numba') if m in sys.modules)); "
            "print(callable(hpcdp.info))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"]


def test_init_imports_torch_only_where_a_gpu_may_be_pinned():
    """``hpcdp.init()`` pins this rank's GPU through torch; on a machine without GPU device
    nodes a numpy-only job does not import torch (seconds per rank). torch imported before
    is used as it is."""
    import glob

    from hpcdp._runtime import _GPU_NODES
    gpu_nodes = any(glob.glob(g) for g in _GPU_NODES)
    for first, expected in (("", gpu_nodes), ("import torch; ", True)):
        code = (f"import sys; {first}import hpcdp; hpcdp.init(); "
                "print('torch' in sys.modules, hpcdp.info()['device'])")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        imported, device = out.stdout.split()
        assert imported == str(expected), (first, out.stdout)
        assert device == "cpu" or gpu_nodes, out.stdout
