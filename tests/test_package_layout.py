"""The package's layout (AUTHORING.md, "The package"): one face per notebook at the top plus the four parts,
no import circle among the package's modules, lessons never importing their checks, references never
importing a check module, and every ``python -m`` / ``torchrun -m`` command the docs show still answering."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mgpu_helpers"

# notebook -> its face: mgpu_helpers/<face>.py, or a package mgpu_helpers/<face>/ whose __init__ is the face
FACES = {"00": "environment", "01": "memory", "02": "profiling", "03": "data_parallel", "04": "ddp",
         "05": "accumulation", "06": "amp", "07": "checkpointing", "08": "sharding", "09": "model_sharding",
         "10": "data_loading", "11": "capstone", "12": "fsdp_practice"}
PARTS = {"runtime", "checks", "tools", "planner"}  # planner: what mgpu-plan runs


def _entries():
    return sorted(p.name for p in PKG.iterdir() if p.name != "__pycache__" and not p.name.startswith("."))


def test_top_level_is_the_lesson_faces_and_the_parts():
    entries = _entries()
    assert len(entries) <= 18, entries
    names = {e.removesuffix(".py") for e in entries} - {"__init__"}
    assert "__init__.py" in entries
    assert names == set(FACES.values()) | PARTS, sorted(names ^ (set(FACES.values()) | PARTS))


def test_every_notebook_names_its_face():
    import json
    for nb_path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        meta = json.loads(nb_path.read_text())["metadata"]["mgpu"]
        assert meta["module"] == FACES[meta["notebook"]], nb_path.name


# --- the import graph, read statically from every module (imports inside functions too) ----------------------

def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """The package's modules ``name`` imports: ``from X import y`` counts as X.y where X.y is a module
    (a submodule), else as X. A relative import is resolved against the module's package."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import mgpu_helpers.x.y` of a name that is not a module: its module
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("mgpu_helpers"):
                found.add(t)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycle():
    """The first cycle found (a list of module names, first == last), else None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(GRAPH):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_the_walker_sees_imports():  # the graph is not empty by mistake
    assert "mgpu_helpers.planner.trace" in GRAPH["mgpu_helpers.planner"]
    assert "mgpu_helpers.planner.accounting" in GRAPH["mgpu_helpers.planner.trace"]
    assert "mgpu_helpers.planner.budget" in GRAPH["mgpu_helpers.planner.plans"]  # inside a function
    assert "mgpu_helpers.runtime.tracker" in GRAPH["mgpu_helpers.planner.trace"]  # relative, two dots


def test_no_import_circle():
    cycle = _cycle()
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_walker_finds_a_circle(monkeypatch):
    monkeypatch.setitem(GRAPH, "mgpu_helpers.planner.accounting",
                        GRAPH["mgpu_helpers.planner.accounting"] | {"mgpu_helpers.planner.trace"})
    cycle = _cycle()
    assert cycle[0] == cycle[-1] and set(cycle) == {"mgpu_helpers.planner.accounting", "mgpu_helpers.planner.trace"}


def test_lessons_never_import_their_checks_and_references_never_a_check():
    checks, refs = "mgpu_helpers.checks", "mgpu_helpers.checks.references"
    for name, deps in GRAPH.items():
        if name == checks or name.startswith(checks + "."):
            if name == refs or name.startswith(refs + "."):
                bad = {d for d in deps if (d == checks or d.startswith(checks + ".")) and not d.startswith(refs)}
                assert not bad, f"{name} (a reference) imports check modules {sorted(bad)}"
            continue
        if name.startswith("mgpu_helpers.tools"):
            continue  # instructors' tools (authoring, grading) load checks: they are not lessons
        bad = {d for d in deps if d == checks or d.startswith(checks + ".")}
        assert not bad, f"{name} imports {sorted(bad)}: a lesson module never imports its checks"


# --- every `python -m` / `torchrun -m` command the docs show -----------------------------------------------------

def _documented_commands() -> dict[str, str]:
    """module -> one command line that names it, from the package's docstrings, README.md, AUTHORING.md and
    the solution notebooks (their markdown shows the scripts too)."""
    texts = [ROOT / "README.md", ROOT / "AUTHORING.md", ROOT / "Makefile", *sorted(PKG.rglob("*.py")),
             *sorted((ROOT / "solutions").glob("*.ipynb"))]
    found = {}
    for path in texts:
        for m in re.finditer(r"-m (mgpu_helpers(?:\.\w+)*)((?: [a-z_]+)?)", path.read_text()):
            found.setdefault(m.group(1), m.group(0))
    return found


COMMANDS = _documented_commands()
NO_HELP = {"mgpu_helpers.tools.grading.judge": "the grader's own subprocess: its one argument is a JSON job"}


def test_the_docs_show_the_lesson_scripts():
    for module in ("mgpu_helpers.environment", "mgpu_helpers.ddp", "mgpu_helpers.sharding", "mgpu_helpers.checks",
                   "mgpu_helpers.data_loading", "mgpu_helpers.fsdp_practice", "mgpu_helpers.tools.lab"):
        assert module in COMMANDS, sorted(COMMANDS)


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_documented_module_runs_help(module):
    assert module in MODULES, f"{COMMANDS[module]!r}: no module {module}"
    main = MODULES[module].parent / "__main__.py" if _is_package(module) else MODULES[module]
    assert main.exists() and ("__main__" in main.name or 'if __name__ == "__main__"' in main.read_text()), \
        f"{COMMANDS[module]!r}: {module} has no script entry"
    if module in NO_HELP:
        pytest.skip(f"{module} takes no --help: {NO_HELP[module]}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "usage:" in proc.stdout.lower(), proc.stdout[-2000:]


# --- importing is free of side effects: no global state flipped, the same figures in any import order ---------

_IMPORT_THEN_PLAN = r'''
import ctypes, importlib, json, os, pkgutil, sys
import torch

def state():
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    flags = {}
    if os.path.exists(lib):  # c10's global flags, read only
        c10 = ctypes.CDLL(lib)
        for name, ctype in (("FLAGS_caffe2_report_cpu_memory_usage", ctypes.c_bool),
                            ("FLAGS_caffe2_log_level", ctypes.c_int)):
            try:
                flags[name] = ctype.in_dll(c10, name).value
            except ValueError:
                pass
    return {"profiler": torch._C._autograd._profiler_enabled(), "threads": torch.get_num_threads(),
            "resize_": repr(torch.UntypedStorage.resize_), "rng": repr(torch.get_rng_state),
            "apply": repr(torch.nn.Module._apply), **flags}

before = state()
import mgpu_helpers
mods = sorted(i.name for i in pkgutil.walk_packages(mgpu_helpers.__path__, "mgpu_helpers.")
              if not i.name.endswith(".__main__"))
order = sys.argv[1]
if order == "reversed":
    mods.reverse()
for m in (mods if order != "planner only" else ["mgpu_helpers.planner"]):
    importlib.import_module(m)
after = state()
from mgpu_helpers.planner import decoder, lm_loss, measure_step, plan, token_batch
batch = token_batch(4, 32, 512)
p = plan(decoder("tiny"), batch, loss_fn=lm_loss, precision="bf16-autocast", checkpointing=True, device="cpu")
m, _ = measure_step(decoder("tiny"), batch, loss_fn=lm_loss, precision="bf16-autocast", checkpointing=True)
print(json.dumps({"before": before, "after": after, "figures": [p.peak_bytes, p.breakdown, m]}))
'''


def test_imports_flip_no_global_state_and_figures_do_not_depend_on_import_order():
    """Importing any of the package's modules leaves torch's and c10's global state as it was (no c10 flag
    set, no profiler, no patched function), and a plan and a tracked step give the same bytes whichever
    modules were imported first: no figure depends on the context it is computed in."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = {}
    for order in ("sorted", "reversed", "planner only"):
        out = subprocess.run([sys.executable, "-c", _IMPORT_THEN_PLAN, order], capture_output=True, text=True,
                             env=env, cwd=ROOT, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[order] = json.loads(out.stdout.strip().splitlines()[-1])
        assert runs[order]["before"] == runs[order]["after"], (order, runs[order])
    figures = [r["figures"] for r in runs.values()]
    assert figures[0] == figures[1] == figures[2] and figures[0][0] == figures[0][2], figures


def test_what_ranks_import_never_asks_cuda():
    """A forkserver imports the course's rank modules once and forks every rank from itself: an import that asks
    CUDA anything (``torch.cuda.is_available()`` calls cudaGetDeviceCount) poisons fork, and every rank on a GPU
    machine then fails with "CUDA error: initialization error". ``torch.utils.cpp_extension`` asks at import
    (its CUDA_HOME lookup), on CUDA builds only: so it is kept out too, which a CPU build can see."""
    code = ("import importlib, sys, torch\n"
            "def asked(*a, **k): raise AssertionError('CUDA asked at import')\n"
            "torch.cuda.is_available = torch.cuda.init = asked\n"
            "from mgpu_helpers.runtime.launch import _RANK_MODULES\n"
            "for m in _RANK_MODULES: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'torch.utils.cpp_extension'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", f"a rank module imports torch.utils.cpp_extension: {proc.stdout}"
