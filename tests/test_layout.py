"""Guards of the tree's shape that the linters (ruff, import-linter; `make lint`) don't check."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60  # a screen: split planning from doing and printing beyond it


def long_functions(root: Path, limit: int) -> list[str]:
    """`file:line name: N lines` for every function under `root` longer than `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: "
                                 f"{lines} lines")
    return found


def test_every_function_fits_a_screen():
    too_long = [f for d in ("flagserve", "kernels")
                for f in long_functions(ROOT / d, MAX_FUNCTION_LINES)]
    assert not too_long, "split these functions:\n" + "\n".join(too_long)


def test_the_guard_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def f():\n{body}\n\n\ndef g():\n    pass\n")
    assert long_functions(tmp_path / "pkg", MAX_FUNCTION_LINES) == [
        f"pkg/m.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
