"""The package stays small enough to change: no function over 50 lines (from its `def` to its last line,
decorators aside, docstring included; the config's `__init__` aside, long by transformers' convention) and no command-line module over 300 lines. Read from the source
with `ast`; nothing is imported."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vanilla_transformer"
MAX_FUNCTION_LINES = 50
MAX_CLI_FILE_LINES = 300
# A config's __init__ takes every field as a keyword with its default and sets it on its own line, as MarianConfig
# does on the transformers versions we support: long by convention, and one line per field is the plain reading.
CONVENTIONAL = {"vanilla_transformer/modeling/configuration_vanilla_transformer.py": {"__init__"}}


def function_lengths(path: Path):
    """(line, name, length) of every function and method in `path`, nested ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.lineno, node.name, node.end_lineno - node.lineno + 1


def test_no_function_over_50_lines():
    long = [f"{path.relative_to(ROOT)}:{line} {name} is {length} lines"
            for path in sorted(PACKAGE.rglob("*.py"))
            for line, name, length in function_lengths(path)
            if length > MAX_FUNCTION_LINES and name not in CONVENTIONAL.get(str(path.relative_to(ROOT)), ())]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split each by job):\n" + "\n".join(long)


def test_no_cli_file_over_300_lines():
    long = [f"{path.relative_to(ROOT)} is {length} lines"
            for path in sorted((PACKAGE / "cli").rglob("*.py"))
            if (length := len(path.read_text(encoding="utf-8").splitlines())) > MAX_CLI_FILE_LINES]
    assert not long, f"command-line modules over {MAX_CLI_FILE_LINES} lines:\n" + "\n".join(long)


def test_the_measures_count_what_they_say(tmp_path):
    """A function's length runs from its `def` (not its decorator) to its last line."""
    source = tmp_path / "example.py"
    source.write_text("@decorator\ndef f():\n    '''Doc.'''\n    return 1\n\n\nclass C:\n    def g(self):\n        pass\n")
    assert list(function_lengths(source)) == [(2, "f", 3), (8, "g", 2)]


def imported_modules(path: Path) -> set[str]:
    """The package's modules that `path` imports, at its top or inside a function, by dotted name."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            target = ".".join(filter(None, [base, node.module or ""]))
            found |= {f"{target}.{alias.name}" for alias in node.names} | {target}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith("vanilla_transformer")}


def test_no_circle_of_imports_in_the_package():
    """No two modules import each other, directly or through others (lazy imports inside functions count too):
    the package reads from the bottom up."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in imported_modules(path) if m in files and m != name} for name, path in files.items()}
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    for name in graph:  # a package's __init__ is not an import of its own modules' neighbours
        graph[name] -= {p for p in packages if name.startswith(p + ".")}
    state, path, circles = {}, [], []

    def visit(name):
        state[name] = "open"
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                circles.append(" -> ".join(path[path.index(other):] + [other]))
            elif other not in state:
                visit(other)
        path.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not circles, "circles of imports:\n" + "\n".join(circles)


def renamed_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, name, alias) of each of the package's own names that `path` imports under another name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("vanilla_transformer")):
            found += [(node.lineno, alias.name, alias.asname) for alias in node.names if alias.asname]
    return found


def test_the_package_imports_its_own_names_by_their_own_names():
    """One meaning per name: a function imported under another name hides a twin of the same name elsewhere
    (`load_tokenizer as read_tokenizer`); the twins get distinct names where they are defined instead."""
    renamed = [f"{path.relative_to(ROOT)}:{line} imports {name} as {alias}"
               for path in sorted(PACKAGE.rglob("*.py")) for line, name, alias in renamed_imports(path)]
    assert not renamed, "give the twin a name of its own where it is defined:\n" + "\n".join(renamed)


def test_the_import_rule_finds_renames_of_our_names_alone(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("import numpy as np\nfrom torch.nn import functional as F\nfrom ..threads import use_threads as set_threads\n"
                      "from vanilla_transformer.metrics import load as load_metric\nfrom .generation import generate_with_added_options\n")
    assert renamed_imports(source) == [(3, "use_threads", "set_threads"), (4, "load", "load_metric")]
