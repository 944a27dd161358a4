# Two commands do all the set-up on a fresh machine:
#   make demo   set up, then run the main job (a broker on a simulated 4-GPU lab server)
#   make test   set up, then run the whole test suite
SHELL := /bin/bash
# root: a venv every user can run (the multi-user tests need that); others: ./.venv
VENV ?= $(if $(filter 0,$(shell id -u)),/opt/vaccel-venv,$(CURDIR)/.venv)
PY := $(VENV)/bin/python

# The lab's install (not a set-up step): `make deb` on Debian and Ubuntu, else `make install`:
# a wheel of this checkout in its own venv, the unit pointing at it, `vaccel` on every user's
# PATH. Never the development venv above.
LAB_VENV ?= /opt/vaccel

.PHONY: setup demo test lint proto bench install deb
setup:
	bash scripts/setup.sh $(VENV)

demo: setup
	$(PY) scripts/demo.py

# -ra lists every skip with its reason; pytest's exit 5 ("no tests ran") fails make too.
test: setup
	$(PY) -m pytest -ra

lint:
	$(PY) -m ruff check .

proto:
	$(PY) scripts/gen_proto.py

bench: setup
	$(PY) -m bench.leases

# Hosts without dpkg; DESTDIR=DIR stages every file it writes under DIR.
install:
	DESTDIR="$(DESTDIR)" bash scripts/install.sh $(LAB_VENV)

# The Debian 12 package: dist/vaccel_VERSION_ARCH.deb (scripts/build_deb.sh; docs/service.md).
deb:
	bash scripts/build_deb.sh
