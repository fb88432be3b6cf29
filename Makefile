# Developer shortcuts. The README's two commands (scripts/up.sh, scripts/test.sh) need no make.
PY := .venv/bin/python

.PHONY: test bench bench-quick bench-store bench-memory bench-durable bench-lifecycle bench-sandbox bench-e2e bench-fleet

test:
	bash scripts/test.sh

# Every benchmark writes bench/results/latest/<area>.{md,json} and prints a headline as its last line.
bench: bench-store bench-memory bench-durable bench-lifecycle bench-sandbox bench-e2e bench-fleet

bench-quick:
	$(PY) bench/store/run.py --quick
	$(PY) bench/lifecycle/run_sim.py --quick

bench-store:
	$(PY) bench/store/run.py

bench-memory:
	$(PY) bench/memory/run.py

bench-durable:
	$(PY) bench/durable/run.py

bench-lifecycle:
	$(PY) bench/lifecycle/run_sim.py
	$(PY) bench/lifecycle/wake_storm.py

bench-sandbox:
	$(PY) bench/sandbox/run.py

bench-e2e:
	$(PY) bench/e2e/run.py

bench-fleet:
	$(PY) bench/fleet/run.py

bench-api:
	$(PY) bench/api/run.py
