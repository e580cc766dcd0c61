"""Where `tessera train --data` reads from: a factory, a text file, JSON lines, or a saved
`datasets` folder, each opened as a map-style data set of (inputs, targets) or dict items.

- `PKG.MODULE:FACTORY`: `FACTORY()` returns the data set, map-style or iterable
  (`tessera.data.stream`);
- `FILE.txt`: the text, tokenised (`tessera.data.text`), cut into windows;
- `FILE.jsonl`: one JSON object per line; objects with the single key "text" are tokenised like
  a text file (joined by newlines), others are items whose fields (numbers or equal-length lists)
  become tensors;
- `DIR`: a `datasets.Dataset.save_to_disk` folder, read with pyarrow (so `datasets` need not be
  installed): a single "text" column is tokenised, other columns become item fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.data.imports import is_reference, load_reference
from tessera.data.stream import is_stream
from tessera.data.text import TokenWindows, load_tokenizer
from tessera.errors import ConfigError

__all__ = ["Columns", "OpenedData", "check_data_spec", "open_data"]


@dataclass(frozen=True)
class OpenedData:
    """A data set and what identifies it for resume (its tokenizer's vocabulary, if tokenised)."""

    dataset: Any
    tokenizer: dict[str, Any] | None = field(default=None)
    """`TextTokenizer.identity` when the data is tokenised text, else None."""


class Columns(torch.utils.data.Dataset):
    """Items `{name: column[i]}` of equal-length tensor columns (dim 0 indexes items)."""

    def __init__(self, columns: dict[str, torch.Tensor]) -> None:
        lengths = {len(c) for c in columns.values()}
        if len(lengths) != 1:
            raise ValueError(f"columns of different lengths {sorted(lengths)}")
        self.columns = columns
        self._length = lengths.pop()

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: column[index] for name, column in self.columns.items()}


def check_data_spec(spec: str, what: str = "--data") -> None:
    """Refuse, without reading anything, a spec that is no existing path and no reference."""
    if Path(spec).exists():
        return
    if spec.endswith((".txt", ".jsonl")) or "/" in spec:
        raise ConfigError(f"{what} {spec}: no such file or folder")
    if not is_reference(spec):
        raise ConfigError(
            f"{what} {spec!r} is neither an existing FILE.txt, FILE.jsonl or folder nor "
            "PKG.MODULE:FACTORY"
        )


def _tensor_columns(rows: dict[str, list[Any]], where: str) -> Columns:
    columns = {}
    for name, values in rows.items():
        try:
            columns[name] = torch.tensor(values)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"{where}: field {name!r} does not form a tensor (numbers, or lists of equal "
                f"length on every row): {exc}"
            ) from None
    return Columns(columns)


def _text(text: str, tokenizer_path: str | None, block_size: int, where: str) -> OpenedData:
    tokenizer = load_tokenizer(tokenizer_path, text)
    try:
        windows = TokenWindows(tokenizer.encode_tensor(text), block_size)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return OpenedData(windows, tokenizer.identity)


def _jsonl(path: Path, tokenizer_path: str | None, block_size: int) -> OpenedData:
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number} is not JSON: {exc}") from None
        if not isinstance(row, dict) or not row:
            raise ConfigError(f"{path}:{number} must hold one non-empty JSON object")
        if rows and row.keys() != rows[0].keys():
            raise ConfigError(
                f"{path}:{number} has keys {sorted(row)}, line 1 has {sorted(rows[0])}"
            )
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path} holds no JSON object")
    if list(rows[0]) == ["text"]:
        return _text("\n".join(str(r["text"]) for r in rows), tokenizer_path, block_size, str(path))
    if tokenizer_path is not None:
        raise ConfigError(f"--tokenizer applies to text; {path} holds fields {list(rows[0])}")
    return OpenedData(_tensor_columns({k: [r[k] for r in rows] for k in rows[0]}, str(path)))


def _arrow_folder(folder: Path, tokenizer_path: str | None, block_size: int) -> OpenedData:
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise ConfigError(
            f"--data {folder} is a DatasetDict: point it at one split's folder ({splits})"
        )
    state = folder / "state.json"
    if not state.is_file():
        raise ConfigError(f"--data {folder} is not a datasets.save_to_disk folder (no state.json)")
    try:
        import pyarrow as pa
    except ImportError:
        raise ConfigError(
            f"--data {folder}: reading a datasets.save_to_disk folder needs pyarrow "
            "(pip install pyarrow)"
        ) from None
    files = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    tables = []
    for name in files:
        with pa.memory_map(str(folder / name)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    table = pa.concat_tables(tables)
    if table.column_names == ["text"]:
        text = "\n".join(str(t) for t in table.column("text").to_pylist())
        return _text(text, tokenizer_path, block_size, str(folder))
    if tokenizer_path is not None:
        raise ConfigError(f"--tokenizer applies to text; {folder} holds {table.column_names}")
    rows = {name: table.column(name).to_pylist() for name in table.column_names}
    return OpenedData(_tensor_columns(rows, str(folder)))


def open_data(
    spec: str, *, tokenizer: str | None, block_size: int, what: str = "--data"
) -> OpenedData:
    """Open the data set `spec` names (see the module docstring); ConfigError if it cannot."""
    check_data_spec(spec, what)
    path = Path(spec)
    if path.is_dir():
        return _arrow_folder(path, tokenizer, block_size)
    if path.is_file():
        if path.suffix == ".txt":
            return _text(path.read_text(), tokenizer, block_size, str(path))
        if path.suffix == ".jsonl":
            return _jsonl(path, tokenizer, block_size)
        raise ConfigError(f"{what} {spec}: a file must be .txt or .jsonl")
    if tokenizer is not None:
        raise ConfigError(f"--tokenizer applies to text files, not to the factory {spec}")
    factory = load_reference(spec, what=what)
    try:
        dataset = factory()
    except Exception as exc:
        raise ConfigError(f"{what} {spec}: the factory raised {type(exc).__name__}: {exc}") from exc
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) and not is_stream(
        dataset
    ):
        raise ConfigError(
            f"{what} {spec} returned a {type(dataset).__name__}: a map-style data set "
            "(__len__ and __getitem__) or an iterable one (IterableDataset, __iter__) is needed"
        )
    return OpenedData(dataset)
