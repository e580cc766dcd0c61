# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

FL_VENV := .venv-fl

.PHONY: demo test lint bench bench-fl gpu-check plan-check clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found: set PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev,federated]" -c constraints.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tessera train

# three tests at a time (pytest-xdist): see the dev extra in pyproject.toml for why
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 3 --dist worksteal

# benchmarks/federated.py with Flower beside tessera: its own venv (Flower pins older packages)
$(FL_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(FL_VENV)
	$(FL_VENV)/bin/pip install --quiet --upgrade pip
	$(FL_VENV)/bin/pip install --quiet -e ".[federated,bench,bench-fl]" -c constraints.txt
	touch $@

bench-fl: $(FL_VENV)/.installed
	$(FL_VENV)/bin/python benchmarks/federated.py

# on a GPU machine: the gpu tests, tessera against the plain loop, torch DDP, FSDP2 and offload
# (under 6 minutes on one GPU); writes BENCHMARKS.md's gpu section. `--cpu` checks it runs here.
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu.py

# on a quiet machine: is `tessera plan --cluster this-machine`'s top row for the demo GPT among the
# two fastest that tessera compare measures (2 and 4 ranks)? Writes BENCHMARKS.md's plan_check.
plan-check: $(STAMP)
	$(BIN)/python benchmarks/plan_check.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(FL_VENV) runs .pytest_cache
