# The README's two commands: `make demo` and `make test`. Both set everything up first.
.PHONY: setup demo test bench clean

setup:
	scripts/setup.sh dev

demo: setup
	.venv/bin/neuralcache demo

test: setup
	.venv/bin/python -m pytest

bench:
	scripts/setup.sh dev,bench

clean:
	rm -rf .venv build *.egg-info .pytest_cache .hypothesis
