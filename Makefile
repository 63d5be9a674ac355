# `make demo`: set up and train MNIST with the default config, then print the official test-set accuracy.
# `make test`: set up and run the whole test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: venv demo test lint clean slurm-up slurm-down

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade -q pip
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

venv: $(STAMP)

demo: venv
	$(BIN)/python cli.py fit
	$(BIN)/python cli.py test --ckpt_path last

# pytest exits 5 when it collected no test: that is a failure here, and it says so.
test: venv
	@$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests - failing"; fi; exit $$rc

# A throwaway SLURM cluster on this machine (root, Debian/apt) for the `slurm` tests: see tools/slurm_cluster.sh.
slurm-up:
	bash tools/slurm_cluster.sh install
	bash tools/slurm_cluster.sh start
	@echo 'now: eval "$$(bash tools/slurm_cluster.sh env)"'

slurm-down:
	bash tools/slurm_cluster.sh stop

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs lightning_logs
