# Two commands set up everything on a fresh machine: `make demo` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: install demo test lint bench peak-avx2 clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test,tune]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py
	$(PY) examples/transformer_demo.py
	$(PY) examples/train_digits.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/passes.py
	$(PY) bench/gradient_pipeline.py --layers 2
	$(PY) bench/train_step.py

peak-avx2: $(STAMP)
	$(PY) bench/roofline.py --isa avx2

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
