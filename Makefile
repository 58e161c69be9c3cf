# Every target mirrors the README; `.ci/run` runs `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench image gpu-test clean

venv: $(STAMP)

# torch is pinned to the CPU build that is on disk first, so the package's torch range is
# already met and pip never downloads a CUDA build. The container gets torch from its base.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: venv
	$(VENV)/bin/pyrecover demo

test: venv
	$(PY) -m pytest

lint: venv
	$(VENV)/bin/ruff check pyrecover tests

clean:
	rm -rf $(VENV) runs data .pytest_cache

# The Apptainer image: CUDA + NCCL + this package (containers/pyrecover.def).
image:
	$(VENV)/bin/pyrecover image build containers/pyrecover.def pyrecover.sif

# GPU tests inside the image; they skip with a reason where there is no GPU.
gpu-test: image
	apptainer exec --nv --bind "$(CURDIR)" --pwd "$(CURDIR)" pyrecover.sif python -m pytest tests/gpu
