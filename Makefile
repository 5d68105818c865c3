# The two commands of the README: `make serve` (the server on the embedded default) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel; a bare `torch` would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: install test serve generate clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest tests

serve: install
	$(VENV)/bin/pagellm serve $(SERVE_ARGS)

generate: install
	$(VENV)/bin/pagellm generate "The capital of France is" "Paged attention saves memory because"

clean:
	rm -rf $(VENV) build *.egg-info
