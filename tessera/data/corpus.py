"""Text corpora that need no download: Python's own standard library, or local files.

The default corpus is a fixed list of pure-Python standard-library modules read from the
interpreter's installation. Every machine with the same Python version therefore trains a
character model on byte-identical text, which is what cross-machine and resume tests need, and
it is a few megabytes of real, structured text (code, comments, docstrings) rather than noise.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

__all__ = ["STDLIB_MEMBERS", "load_corpus", "stdlib_corpus_dir"]

# Well-known, pure-Python modules and packages, sorted by name. Fixed, so that the corpus does
# not change when a distribution adds or patches other files; members missing from a given
# Python version are skipped (same version -> same text). About 3 MB on Python 3.11.
STDLIB_MEMBERS: tuple[str, ...] = (
    "argparse.py",
    "ast.py",
    "asyncio",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "collections",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "email",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "inspect.py",
    "json",
    "logging",
    "random.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "threading.py",
    "typing.py",
    "unittest",
)


def stdlib_corpus_dir() -> Path:
    """Folder holding the standard library's ``.py`` sources of the running interpreter."""
    path = Path(sysconfig.get_paths()["stdlib"])
    if not path.is_dir():
        raise FileNotFoundError(f"standard-library source folder not found: {path}")
    return path


def _is_hidden(path: Path, root: Path) -> bool:
    return any(
        part.startswith(".") or part == "__pycache__" for part in path.relative_to(root).parts
    )


def _files_under(root: Path, pattern: str) -> list[Path]:
    """Regular files matching ``pattern`` below ``root``, sorted by path (deterministic order)."""
    files = (p for p in root.rglob(pattern) if p.is_file() and not _is_hidden(p, root))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _stdlib_files() -> list[Path]:
    root = stdlib_corpus_dir()
    files: list[Path] = []
    for member in STDLIB_MEMBERS:
        path = root / member
        if path.is_dir():
            files += _files_under(path, "*.py")
        elif path.is_file():
            files.append(path)
    return files


def _read_until(files: list[Path], max_bytes: int) -> bytes:
    """Concatenate the files in order, stopping once ``max_bytes`` bytes are read."""
    chunks: list[bytes] = []
    remaining = max_bytes
    for path in files:
        if remaining <= 0:
            break
        data = path.read_bytes()[:remaining]
        chunks.append(data)
        remaining -= len(data)
    return b"".join(chunks)


def load_corpus(source: str = "stdlib", *, max_bytes: int = 2_000_000) -> str:
    """Return up to ``max_bytes`` bytes of text, decoded as UTF-8 (bad bytes become U+FFFD).

    ``source`` is ``"stdlib"`` (the fixed standard-library corpus above), a text file, or a
    folder whose non-hidden files are read recursively in sorted path order. A missing path
    raises ``FileNotFoundError`` naming it; a source with no text raises ``ValueError``.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if source == "stdlib":
        files = _stdlib_files()
    else:
        path = Path(source).expanduser()
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = _files_under(path, "*")
        else:
            raise FileNotFoundError(
                f"corpus path does not exist: {str(path)!r} "
                "(expected 'stdlib', a text file or a folder of text files)"
            )
    data = _read_until(files, max_bytes)
    if not data:
        raise ValueError(f"corpus {source!r} contains no text")
    return data.decode("utf-8", errors="replace")
