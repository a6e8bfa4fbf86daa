# Every target sets up what it needs first (scripts/bootstrap.sh: a cached venv outside the
# clone, keyed by the dependency pins), so each works on a fresh machine.
VENV = $$(bash scripts/bootstrap.sh)

.PHONY: simulate demo train-demo sweep bench-async bench-tail bench-drafts test test-slow test-fast test-peers test-aot check bench-kv bench-resume bench-routing bench-buffer bench-weights bench-fleet bench-placement gpu-check gpu-check-dry soak chaos

demo:  ## server on the embedded CPU default + the APRIL load test: table + plots in out/
	@V=$(VENV) && $$V/bin/april-bench --quick --json-out out/bench.jsonl --plot-dir out

train-demo:  ## TRL's GRPOTrainer on april-server, sync vs APRIL vs APRIL + background (server and trainer on separate cores), same seed, equal wall time (TRAIN_ARGS="--seeds 0,1,2": three seeds): out/train.jsonl + out/train.png
	@V=$(VENV) && $$V/bin/python -m examples.train_demo --out out/train.jsonl --plot out/train.png $(TRAIN_ARGS)

sweep:  ## sync vs static vs adaptive APRIL on the four issue-#6 configurations, 3 runs each (~60 min on a 2-core CPU)
	@V=$(VENV) && $$V/bin/april-bench --quick --sweep --repeat 3 --json-out out/sweep.jsonl --plot-dir out/sweep

bench-async:  ## never idle: sync vs april vs april-async, a trainer of TRAIN_S s between calls (default auto: as long as sync's rollout in the same run), max_staleness 1, 3 interleaved repeats (~5 min)
	@V=$(VENV) && $$V/bin/april-bench --quick --sweep-point tiny:512:8x4 --repeat 3 --modes sync,april,april-async --train-s $${TRAIN_S:-auto} --max-staleness 1 --json-out out/async.jsonl

bench-tail:  ## tail-aware rollouts on real text (HumanEval prompts on SmolLM2, lengths set by the model): sync vs APRIL vs tail-aware APRIL (predicted-longest first, pool sized by the server), 10 steps, 3 repeats (~50 min)
	@V=$(VENV) && $$V/bin/april-bench --workload text --sweep-point smollm2:192:4x4 --repeat 3 --modes sync,april@auto,april-tail@auto --steps 10 --prompts 8 --json-out out/tail.jsonl

bench-drafts:  ## drafts from history, offline: n-gram drafts from a prompt's earlier rollouts vs prompt lookup, acceptance on real SmolLM2 samples (~3 min)
	@V=$(VENV) && $$V/bin/python -m examples.drafts

PYTEST = python -m pytest -q -p no:cacheprovider --durations=25

test:  ## every behaviour: unit + kernels in 2 workers, then end to end on a real SGLang (serial); not the slow tier
	@V=$(VENV) && $$V/bin/$(PYTEST) -m "not e2e and not slow" -n 2 && $$V/bin/$(PYTEST) -m "e2e and not slow" tests/e2e

test-slow:  ## the slow tier: full-size storm and chaos soaks, the whole kernel grid in the Triton interpreter
	@V=$(VENV) && $$V/bin/$(PYTEST) -m slow

test-fast:  ## without the end-to-end tests (no SGLang server)
	@V=$(VENV) && $$V/bin/$(PYTEST) -m "not e2e and not slow" -n 2

test-peers:  ## slime, verl 0.9.1 and AReaL 1.0.4 drive a live server through april_client's adapters: slime from its pinned source beside the checkout, in our venv, verl and AReaL each in its own cached venv (scripts/peer-venv.sh; first build ~1-2 min each)
	@V=$(VENV) && VERL=$$(bash scripts/peer-venv.sh verl) && AREAL=$$(bash scripts/peer-venv.sh areal) && \
	$$V/bin/$(PYTEST) tests/e2e/test_slime_e2e.py && \
	APRIL_SERVER_PYTHON=$$V/bin/python APRIL_TEST_ZYGOTE=0 $$VERL/bin/$(PYTEST) -m peers tests/peers/test_verl_e2e.py && \
	APRIL_SERVER_PYTHON=$$V/bin/python APRIL_TEST_ZYGOTE=0 $$AREAL/bin/$(PYTEST) -m peers tests/peers/test_areal_e2e.py

test-aot:  ## KV kernels compiled ahead of time for sm_80/90/100 and their code checked (no GPU, ~100 s)
	@V=$(VENV) && $$V/bin/python -m pytest -q -p no:cacheprovider tests/kernels/test_aot.py

gpu-check:  ## one CUDA device, <= 10 min: parity, KV GB/s, resume 1k/4k/16k on an 8B shape, april-bench
	@bash scripts/gpu-check.sh

gpu-check-dry:  ## what a CPU can check of the GPU run (~2 min)
	@bash scripts/gpu-check.sh --dry-run

check:  ## format, lint, types
	@V=$(VENV) && $$V/bin/ruff format --check . && $$V/bin/ruff check . && $$V/bin/mypy

bench-kv:  ## KV save/restore GB/s (CPU here; `--device cuda` on a GPU machine)
	@V=$(VENV) && $$V/bin/python -m kernels.bench_kv_copy --quick

bench-resume:  ## resume time, KV restore vs re-prefill, 1k/4k-token partials (tiny, SmolLM2)
	@V=$(VENV) && $$V/bin/python -m april_bench.resume

bench-routing:  ## routing replay on the tiny MoE: throughput with routing on vs off, routing bytes per position on the wire and in a snapshot (~1 min)
	@V=$(VENV) && $$V/bin/python -m april_bench.routing_cost --repeats 5 --json-out out/bench-routing.json

bench-buffer:  ## the partial buffer at 1M samples: store/manager/routes in process, then /health beside big calls on the embedded model
	@V=$(VENV) && $$V/bin/python -m april_bench.buffer --json-out out/bench-buffer.json

bench-weights:  ## a weight push from disk vs over the wire (gloo), tiny and SmolLM2, idle and beside background generation (~4 min)
	@V=$(VENV) && $$V/bin/python -m april_bench.weights --json-out out/bench-weights.jsonl

bench-placement:  ## tail placement on an owner over two SmolLM2 engines (same cores): least_loaded vs tail, real text, 3 alternated repeats (~15 min)
	@V=$(VENV) && $$V/bin/python -m april_bench.fleet --layouts 2 --engine-model smollm2 --placements least_loaded,tail --repeat 3 --json-out out/placement.jsonl -- --workload text --model smollm2 --max-tokens 192 --groups 4 --n 4 --modes april@auto --steps 3 --prompts 8

bench-fleet:  ## april-bench against one server, then an owner over 1 and 2 engine servers on the same cores (~5 min)
	@V=$(VENV) && $$V/bin/python -m april_bench.fleet --json-out out/fleet.jsonl

simulate:  ## the core's deterministic simulator (tests/sim): SEEDS seeds (default 10000) from START (0), with seeded faults unless FAULTS=off, seeds/s shown; a failure prints the command that replays it
	@V=$(VENV) && PYTHONHASHSEED=0 $$V/bin/python -m tests.sim --seeds $${SEEDS:-10000} --start $${START:-0} $(if $(filter off,$(FAULTS)),--no-faults)

soak:  ## the storm test at 10x its CI size
	@V=$(VENV) && APRIL_STORM_OPS=10000 $$V/bin/python -m pytest -q -p no:cacheprovider -s tests/e2e/test_storm_e2e.py -k quick

chaos:  ## random clients (calls, abandoned streams, retries, aborts, deletes, pushes) for 5 min on one server, then 5 min on an owner over 2 engines (one killed -9 twice)
	@V=$(VENV) && $$V/bin/python -m tests.chaos --duration-s $${CHAOS_S:-300} --mode server && $$V/bin/python -m tests.chaos --duration-s $${CHAOS_S:-300} --mode owner
