# Every target mirrors the README; `.ci/run` runs `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv system-deps demo test lint bench bench-restart image gpu-test gpu-check clean

venv: $(STAMP)

# What the tests need from the OS: a real SLURM (slurm-wlm, munge), bubblewrap for the
# apptainer stand-in, shellcheck for rendered scripts. Installed with apt-get when missing
# and we are root; otherwise the command to run is printed.
SYSTEM_PKGS := slurm-wlm slurmctld slurmd slurm-client munge bubblewrap shellcheck
system-deps:
	@missing=""; for c in sbatch slurmctld slurmd munged bwrap shellcheck; do \
	  command -v $$c >/dev/null 2>&1 || missing="$$missing $$c"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing (apt-get: $(SYSTEM_PKGS))"; \
	    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	      --no-install-recommends $(SYSTEM_PKGS) >/dev/null; \
	  else \
	    echo "missing:$$missing; run: sudo apt-get install $(SYSTEM_PKGS)"; exit 1; \
	  fi; \
	fi

# torch is pinned and installed first, so the package's torch range is already met. pip takes
# the CPU build where it has one on disk (find-links: CI never downloads a CUDA build) or from
# TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu; its +cpu version sorts above
# PyPI's). The container gets torch from its base.
TORCH_INDEX ?=
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--extra-index-url "$(TORCH_INDEX)")
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: venv
	$(VENV)/bin/pyrecover demo

# Two pytest workers: the SLURM tests leave a core idle about half their time (the cluster's
# clock), and a CI machine has two. TEST_WORKERS=0 runs the tests one at a time.
TEST_WORKERS ?= 2
test: venv system-deps
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

lint: venv
	$(VENV)/bin/ruff check pyrecover tests

clean:
	rm -rf $(VENV) runs data .pytest_cache

# The Apptainer image: CUDA + NCCL + this package (containers/pyrecover.def).
image: venv
	$(VENV)/bin/pyrecover image build containers/pyrecover.def pyrecover.sif

# GPU tests inside the image; they skip with a reason where there is no GPU.
gpu-test: image
	apptainer exec --nv --bind "$(CURDIR)" --pwd "$(CURDIR)" pyrecover.sif python -m pytest tests/gpu

# Every GPU path on a machine with an NVIDIA GPU and a CUDA torch already installed (no
# container, SLURM, network, wandb or spython): tests/gpu, bench train on gpt-125m (every mode,
# memory with a snapshot every step, the plain compiled loop), bench ckpt at 2 GB, bench memory
# (snapshots at world size 2 on the CPU cores), bench compile (a restart's first step with the
# run's compile cache vs an empty one), bench restart --local
# (signal and crash to the first resumed step without SLURM: CPU at world sizes 2 and 4, and
# the GPU). One report: runs/gpu-check/report.txt and report.json. Uses that machine's python3
# and its torch. Split over several commands (a machine that limits one command's time):
# make gpu-check GPU_CHECK_ARGS="--only tests --only train", then the other steps; each
# call keeps the steps of the report already there.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e . \
	  || echo "gpu-check: pip could not install the package; running it from the source tree"
	PYTHONPATH="$(CURDIR)" $(GPU_PYTHON) -m pyrecover bench gpu-check --out runs/gpu-check \
	  $(GPU_CHECK_ARGS)

# Checkpoint speed on this machine's disk against its raw limit and torch.save/load, then
# training throughput with each mode vs. none (README "Benchmarks"), on the tiny test model,
# then memory mode at world size 2 (2 local processes).
# A few minutes on an idle 2-core machine; point `pyrecover bench ckpt --dir` at real
# storage with a real --size-gb, and `bench train --config` at a real experiment.
BENCH_DIR ?= runs/bench
BENCH_CORPUS := $(BENCH_DIR)/stdlib.parquet
bench: venv
	@mkdir -p $(BENCH_DIR)
	@[ -f $(BENCH_CORPUS) ] || $(VENV)/bin/pyrecover data prepare --max-mb 5 \
	  "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" $(BENCH_CORPUS)
	$(VENV)/bin/pyrecover bench ckpt --dir $(BENCH_DIR) --size-gb 0.25 --repeat 3
	$(VENV)/bin/pyrecover bench train --config launch/experiments/tiny.yaml \
	  --set data.path=$(BENCH_CORPUS) --interval 10 --steps 30 --warmup 5 --repeat 3
	$(VENV)/bin/pyrecover bench memory --dir $(BENCH_DIR) --size-gb 0.25 --repeat 3 \
	  --config launch/experiments/tiny.yaml --set data.path=$(BENCH_CORPUS) --steps 30 --warmup 5

# Signal and crash to the first resumed step of a real 2-task job, on a throwaway local SLURM
# cluster (tests/localslurm.py; root, SLURM installed: `make system-deps`), stopped again
# afterwards. Set RESTART_ARGS="--state-gb 1" for a 1 GB state. On a real cluster run
# `pyrecover bench restart` itself with that cluster's profile (README "Restart").
RESTART_ARGS ?=
# LOCAL_NODES=3 RESTART_ARGS="--spare-nodes 1 --interrupt crash": the restart inside the
# allocation, on a cluster with a node to spare.
LOCAL_NODES ?= 2
bench-restart: venv system-deps
	@mkdir -p $(BENCH_DIR)
	@[ -f $(BENCH_CORPUS) ] || $(VENV)/bin/pyrecover data prepare --max-mb 5 \
	  "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" $(BENCH_CORPUS)
	@cluster="$$(mktemp -d /tmp/pyrecover-slurm.XXXXXX)"; \
	trap '$(PY) tests/localslurm.py stop "'"$$cluster"'"; rm -rf "'"$$cluster"'"' EXIT; \
	eval "$$($(PY) tests/localslurm.py start "$$cluster" --nodes $(LOCAL_NODES))" || exit 1; \
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/pyrecover bench restart --dir $(BENCH_DIR) \
	  --cluster launch/clusters/local.yaml --config launch/experiments/tiny.yaml \
	  --set data.path=$(CURDIR)/$(BENCH_CORPUS) --nodes 2 --gpus-per-node 1 --launcher none \
	  --repeat 3 $(RESTART_ARGS)
