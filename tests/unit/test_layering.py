"""The layers are enforced here, not by care: ``hvd_balance.core`` runs where TensorFlow and
Horovod cannot be imported, the library never imports the tools, and no two modules import
each other (directly or around a longer cycle)."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hvd_balance"
FRAMEWORKS = ("tensorflow", "horovod", "keras", "tf_keras")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """Every module ``path`` imports, at the top or inside a function, as absolute names."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            yield module
            for a in node.names:  # `from . import collective` imports a module
                yield f"{module}.{a.name}"


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: sorted({i for i in _imports(p) if i in modules and i != m}) for m, p in modules.items()}


def test_core_imports_no_framework_and_nothing_outside_core():
    for path in (PACKAGE / "core").rglob("*.py"):
        for imported in _imports(path):
            top = imported.split(".")[0]
            assert top not in FRAMEWORKS, f"{path.name} imports {imported}"
            if top == "hvd_balance":
                assert imported.startswith(("hvd_balance.core", "hvd_balance._version")), \
                    f"{path.name} imports {imported}"


def test_the_library_never_imports_the_tools():
    for path in list((PACKAGE / "core").rglob("*.py")) + list((PACKAGE / "keras").rglob("*.py")):
        for imported in _imports(path):
            assert not imported.startswith("hvd_balance.tools"), f"{path} imports {imported}"


def test_no_module_cycle():
    graph = _graph()
    state = {}

    def visit(module, trail):
        if state.get(module) == "done":
            return
        if state.get(module) == "open":
            cycle = trail[trail.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        state[module] = "open"
        for target in graph[module]:
            # A package imports its submodules' public names; a submodule importing its own
            # package's __init__ is the only edge that is never a real cycle to untangle.
            if module.startswith(target + "."):
                continue
            visit(target, trail + [module])
        state[module] = "done"

    for module in graph:
        visit(module, [])


def test_plan_save_load_and_simulate_run_without_tensorflow_or_horovod(tmp_path):
    """In a fresh Python whose import system refuses TensorFlow, Horovod and Keras."""
    code = textwrap.dedent(f"""
        import sys

        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {FRAMEWORKS!r}:
                    raise ImportError(f"{{name}} is blocked in this test")

        sys.meta_path.insert(0, Refuse())
        try:
            import tensorflow
        except ImportError:
            pass
        else:
            raise SystemExit("the blocker did not work")

        import hvd_balance
        from hvd_balance import Plan, plan_batches
        from hvd_balance.core import simulation
        from hvd_balance.tools import cli

        plan = plan_batches([[(8, 0.010), (32, 0.030)], [(8, 0.040), (32, 0.120)]], 64)
        plan.save({str(tmp_path / "plan.yaml")!r})
        again = Plan.load({str(tmp_path / "plan.yaml")!r}, world_size=2, global_batch_size=64)
        assert again == plan, (again, plan)
        result = simulation.simulate(simulation.make_cluster(16, seed=1), steps=100, seed=1, series=False)
        assert result["strategies"]["static"]["speedup_vs_uniform"] > 1.0
        assert cli.main(["plan", "--rates", "300,100", "-B", "64"]) == 0
        assert not [m for m in sys.modules if m.split(".")[0] in {FRAMEWORKS!r}]
        print("OK", plan.batch_sizes)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK (" in done.stdout


def test_test_modules_have_unique_names():
    """pytest imports test modules by basename (rootdir import mode): two test files of one
    name in different folders stop the whole collection, so CI would run nothing."""
    names = {}
    for path in sorted((PACKAGE.parent / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
