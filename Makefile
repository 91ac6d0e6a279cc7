# The two set-up commands of the README: `make run` (main job on the tiny model, CPU) and `make test`.
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	@test -x $(VENV)/bin/python || { PY=$$(scripts/find_python.sh) && $$PY -m venv $(VENV); }
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test]'
	@touch $(STAMP)

.PHONY: venv run test
venv: $(STAMP)

run: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/cpkv-jax generate --model tiny --prompt "The quick brown fox" --tokens 11,42,7,300,5,19,64,128 --max-new-tokens 16 --page-size 16 --json

test: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -q -n 2 --dist worksteal --durations=20
