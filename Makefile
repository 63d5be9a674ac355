# `make demo`: set up and train MNIST with the default config, then print the official test-set accuracy.
# `make test`: set up and run the whole test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: venv demo test lint clean slurm-up slurm-down update-pins

# The tested set of every package (constraints.txt), so that `make test` tomorrow installs what passed today.
$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q 'pip>=24,<27'
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev]'
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

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs lightning_logs
