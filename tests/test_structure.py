"""The size limits of DESIGN.md hold for every module of `tessera`: no file over 500 lines, no
function of 80 lines or more and no function or constructor with 10 or more parameters unless its
docstring says why.

A function's length is its code: from its `def` to its last line, less its docstring (a docstring
that explains is welcome at any length). Its parameters are those a caller names (`self` and `cls`
not counted, nor `*args` and `**kwargs`). The reason is a docstring line that starts with
`Why so long:` or `Why so many parameters:`; a constructor may give it in its class's docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tessera

PACKAGE = Path(tessera.__file__).parent
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 10
LONG_REASON = "Why so long:"
WIDE_REASON = "Why so many parameters:"


def _says(docstring: str | None, reason: str) -> bool:
    return any(line.strip().startswith(reason) for line in (docstring or "").splitlines())


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
    return lines


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    named = args.posonlyargs + args.args + args.kwonlyargs
    return sum(arg.arg not in ("self", "cls") for arg in named)


def offenders(source: str, filename: str) -> list[str]:
    """`file:line name: what` for each function of `source` over a limit without its reason."""
    tree = ast.parse(source)
    class_doc = {
        id(item): ast.get_docstring(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for item in node.body
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docs = [ast.get_docstring(node)]
        if node.name == "__init__":
            docs.append(class_doc.get(id(node)))
        where = f"{filename}:{node.lineno} {node.name}"
        lines, count = _code_lines(node), _parameters(node)
        if lines >= MAX_FUNCTION_LINES and not any(_says(d, LONG_REASON) for d in docs):
            found.append(f"{where}: {lines} lines, and no '{LONG_REASON}' in its docstring")
        if count >= MAX_PARAMETERS and not any(_says(d, WIDE_REASON) for d in docs):
            found.append(f"{where}: {count} parameters, and no '{WIDE_REASON}' in its docstring")
    return found


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_over_500_lines():
    sizes = {path: len(path.read_text().splitlines()) for path in _modules()}
    over = [f"{p.relative_to(PACKAGE.parent)}: {n}" for p, n in sizes.items() if n > MAX_FILE_LINES]
    assert not over, "split by concept (DESIGN.md, Layout):\n" + "\n".join(over)


def test_long_or_wide_functions_say_why():
    found = []
    for path in _modules():
        found += offenders(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "split them, or say why in the docstring:\n" + "\n".join(found)


def test_the_check_finds_long_and_wide_functions_and_reads_their_reasons():
    def body(lines: int) -> str:  # a function of `lines` code lines: its def, then these
        return "".join(f"    x{i} = {i}\n" for i in range(lines - 1))

    wide = ", ".join(f"a{i}" for i in range(MAX_PARAMETERS))
    source = (
        f"def long():\n    '''Many steps.'''\n{body(MAX_FUNCTION_LINES)}"
        f"def long_why():\n    '''Many steps.\n\n    {LONG_REASON} a table.'''\n{body(90)}"
        f"def short():\n    '''Short.'''\n{body(MAX_FUNCTION_LINES - 1)}"
        f"def wide({wide}):\n    '''Many knobs.'''\n    pass\n"
        f"def narrow(self, {wide[: wide.rindex(',')]}, *args, **kwargs):\n    pass\n"
        f"class Knobs:\n    '''Many knobs.\n\n    {WIDE_REASON} the C signature.'''\n\n"
        f"    def __init__(self, {wide}):\n        pass\n"
        f"class Bare:\n    '''A class.'''\n\n    def __init__(self, {wide}):\n        pass\n"
    )
    found = offenders(source, "m.py")
    assert [line.split(":")[1].split()[1] for line in found] == ["long", "wide", "__init__"]
    assert "80 lines" in found[0] and "10 parameters" in found[1]
    assert found[2].startswith(f"m.py:{source.splitlines().index('class Bare:') + 4} ")
