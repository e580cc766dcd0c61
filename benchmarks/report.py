"""Assemble BENCHMARKS.md from the markdown sections the benchmarks write into results/."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
ORDER = (
    "train",
    "train_precision",
    "comm",
    "comm_gather",
    "ddp",
    "zero",
    "pipeline",
    "tensor_parallel",
)

HEADER = """# Benchmarks

Each section is written by `benchmarks/<name>.py`, which runs tessera and its anchor side by side
in one run (alternating, medians of repeats) and records ratios; `python benchmarks/report.py`
folds the sections into this file. Absolute times depend on the machine; the ratios are the claim.
Benchmarks are not tests: CI does not run them.
"""


def main() -> None:
    """Write BENCHMARKS.md next to the benchmarks folder."""
    results = HERE / "results"
    names = [n for n in ORDER if (results / f"{n}.md").exists()]
    names += sorted(p.stem for p in results.glob("*.md") if p.stem not in ORDER)
    sections = []
    for name in names:
        text = (results / f"{name}.md").read_text().strip()
        sections.append(text if text.startswith("## ") else f"## {name}\n\n{text}")
    (HERE.parent / "BENCHMARKS.md").write_text(HEADER + "\n" + "\n\n".join(sections) + "\n")
    print(f"BENCHMARKS.md: {', '.join(names)}")


if __name__ == "__main__":
    main()
