"""The package layout: imports point down the layer order written in `llama_jax/__init__.py`,
modules import no cycle, every package says what it owns, no function runs past a screenful,
`import llama_jax` stays light, and the console scripts are the modules' command lines."""

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import llama_jax

PACKAGE = Path(llama_jax.__file__).parent
MAX_FUNCTION_LINES = 100  # a longer function does more than one thing: split it
# The imports allowed up the layer order, each a command line that runs what sits above it:
# the planner's CLI compiles the plan it printed (`--compile`), the server's compiles its programs
# (`--compile-only`); their libraries never do.
UPWARD = {("llama_jax.plan.info", "llama_jax.aot.training"),
          ("llama_jax.serve.__main__", "llama_jax.aot.serving")}


def layer_order() -> list[list[str]]:
    """The layers of the package docstring's table, bottom first: each row's first column
    names one or more packages or root modules."""
    rows, table = [], llama_jax.__doc__.split("\n\n")[2]
    for line in table.splitlines():
        names = line[:31].strip()  # the first column; a row may continue on the next lines
        if names and rows and rows[-1][-1] == "":
            rows[-1] = rows[-1][:-1] + [n.strip() for n in names.split(",")]
        elif names:
            rows.append([n.strip() for n in names.split(",")])
    return rows


def unit_of(module: str) -> str:
    """The layer unit of a dotted module name: its package under llama_jax, or a root module."""
    return module.split(".")[1]


def llama_imports(path: Path) -> set[str]:
    """The llama_jax modules that a file imports at run time (anywhere in it, functions
    included), leaving out imports under `if TYPE_CHECKING:`, which only name types."""
    tree = ast.parse(path.read_text())
    type_only = {id(node) for branch in ast.walk(tree) if isinstance(branch, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(branch.test)
                 for stmt in branch.body for node in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("llama_jax.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("llama_jax."):
                found.add(node.module)
            elif node.module == "llama_jax":
                found |= {f"llama_jax.{a.name}" for a in node.names}
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_layer_table_names_every_package_and_root_module_once():
    named = [unit for row in layer_order() for unit in row]
    assert len(named) == len(set(named))
    units = {unit_of(m) for m in MODULES if m != "llama_jax"}
    assert set(named) == units


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "llama_jax"))
def test_imports_point_down_the_layer_order(module):
    rank = {unit: i for i, row in enumerate(layer_order()) for unit in row}
    mine = rank[unit_of(module)]
    for imported in llama_imports(MODULES[module]):
        assert imported in MODULES or imported.rsplit(".", 1)[0] in MODULES, imported
        theirs = rank[unit_of(imported)]
        assert theirs <= mine or (module, imported) in UPWARD, (
            f"{module} (layer {mine}) imports {imported} (layer {theirs}, above it)")


def test_no_import_cycle_between_modules():
    graph = {m: {i if i in MODULES else i.rsplit(".", 1)[0] for i in llama_imports(p)} - {m}
             for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, "import cycle: " + " -> ".join([*path, m, n])
            if n not in state:
                visit(n, [*path, m])
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m, [])


@pytest.mark.parametrize("init", sorted(p for p in PACKAGE.rglob("__init__.py")))
def test_every_package_says_what_it_owns(init):
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and len(doc.split()) >= 20, init


def test_no_function_is_over_max_function_lines():
    long = [f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for module, path in MODULES.items()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_import_llama_jax_is_light_and_the_api_resolves():
    code = ("import sys, llama_jax\n"
            "heavy = [m for m in ('jax', 'grain', 'orbax', 'tqdm', 'optax', 'flax') "
            "if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "missing = [n for n in llama_jax.__all__ if not hasattr(llama_jax, n)]\n"
            "assert not missing, missing\n"
            "import llama_jax.training.trainer\n"
            "assert callable(llama_jax.train)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_the_command_line_entry_points_catch_every_user_error():
    from llama_jax import cli, errors
    errors_ = [e for e in vars(errors).values()
               if isinstance(e, type) and issubclass(e, Exception) and e is not errors.UserError]
    assert errors_ and all(issubclass(e, errors.UserError) for e in errors_)

    @cli.user_errors_exit
    def main(error):
        raise error("bad value")

    for error in errors_:
        assert main(error) == 2
    with pytest.raises(KeyError):
        main(KeyError)


SCRIPTS = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_console_script_is_a_command_line(script, monkeypatch, capsys):
    """The installed script calls its target with no arguments and exits with what it returns:
    the target reads the command line from sys.argv."""
    module, _, name = SCRIPTS[script].partition(":")
    main = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out
