# The two commands of the README.  Both do all set-up on a fresh machine.
.PHONY: demo test setup

setup:
	./scripts/setup.sh

# main job: the real engine on the generated tiny model, clean and with an
# injected lifetime fault; prints what kvsan found
demo: setup
	.venv/bin/kvsan demo

test: setup
	.venv/bin/python -m pytest -q
