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
	nl=$$(printf '\n_'); nl=$${nl%_}; \
	JAX_PLATFORMS=cpu $(VENV)/bin/cpkv-jax generate --model tiny --max-new-tokens 64 --page-size 16 \
	  --prompt " base756 return945 num883 new590 file001 and297 pro857 fun422 try497 whi494 def174 this229 lin902 path425 not709 for482 | fun" \
	  --prompt "347 + 085$$nl" \
	  --prompt "$$(printf '    def __repr__(self):\n        return ')"

test: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -q -n 2 --dist worksteal --durations=20
