"""Real agent clients against the real `deepinfer serve` (the default model): Codex CLI over
/v1/responses, Claude Code over /v1/messages, the openai-agents SDK over both OpenAI APIs.

A 135M model does no useful agent work; what is checked is that each client accepts every
response and event the server sends and ends its turn without a protocol error. The npm CLIs
come from `make agent-clients` (build/npm); without npm they are skipped, saying so. Output is
bounded so each turn stays short: Claude Code asks for 32,000 tokens unless told otherwise, and
Codex sends no bound at all (so it samples to the end of the context unless the server has
`--default-max-tokens`, as an agent deployment would). The clients' own system prompts are
replaced by a short one so their requests fit the model's 8k context; their tools stay.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL
from tests.server.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.agents]

NPM_BIN = Path(__file__).resolve().parents[2] / "build" / "npm" / "node_modules" / ".bin"
CLIENT_TIMEOUT_S = 540
DEFAULT_MAX_TOKENS = 128


@pytest.fixture(scope="module")
def server():
    # Dequantized: Codex's first prompt is ~4,500 tokens (its tool schemas), and the fp32 path
    # prefills it about twice as fast as the packed GGUF one, whose rows all go through the
    # per-row attention kernel (see attention/cpu_paged.py).
    process = ServerProcess(
        "--api-key", API_KEY, "--default-max-tokens", str(DEFAULT_MAX_TOKENS), "--quantization", "none"
    ).start()
    yield process
    assert process.stop() == 0, process.log_tail()


def npm_cli(name: str) -> Path:
    path = NPM_BIN / name
    if not path.exists():
        if shutil.which("npm") is None:
            pytest.skip(
                f"npm is not installed, so the {name} CLI is not either (make agent-clients installs it)"
            )
        pytest.fail(f"{path} is missing: run `make agent-clients`")
    return path


class RecordingProxy:
    """Forwards requests to the server unchanged (streams included) and keeps their JSON bodies,
    so a test can check what the real client sent."""

    def __init__(self, target: str) -> None:
        self.bodies: list[dict[str, Any]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-type", "").startswith("application/json"):
                    proxy.bodies.append(json.loads(raw))
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                with httpx.stream(
                    "POST", target + self.path, content=raw, headers=headers, timeout=CLIENT_TIMEOUT_S
                ) as upstream:
                    self.send_response(upstream.status_code)
                    for key, value in upstream.headers.items():
                        if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(key, value)
                    self.send_header("connection", "close")
                    self.end_headers()
                    for chunk in upstream.iter_raw():
                        self.wfile.write(chunk)
                        self.wfile.flush()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def test_codex_exec_completes_a_turn_over_responses(server, tmp_path: Path) -> None:
    codex = npm_cli("codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    (tmp_path / "instructions.md").write_text("You are a terse assistant. Answer in one short sentence.\n")
    with RecordingProxy(server.url) as proxy:
        (home / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "deepinfer"\n'
            "[model_providers.deepinfer]\n"
            f'name = "deepinfer"\nbase_url = "{proxy.url}/v1"\nenv_key = "DEEPINFER_API_KEY"\n'
            'wire_api = "responses"\nrequest_max_retries = 0\nstream_max_retries = 0\n'
        )
        result = subprocess.run(
            [
                str(codex),
                "exec",
                "--skip-git-repo-check",
                "-c",
                f"model_instructions_file={tmp_path / 'instructions.md'}",
                "--disable",
                "goals",
                "--disable",
                "apps",
                "--disable",
                "image_generation",
                "Say hi.",
            ],
            env={**os.environ, "CODEX_HOME": str(home), "DEEPINFER_API_KEY": API_KEY},
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
        )
    log = result.stdout + result.stderr
    # The turn completed, or it ended at the server's output bound (codex reports the
    # `incomplete` response as an error and exits 1): never on an event it could not read.
    errors = [line for line in log.splitlines() if "ERROR" in line]
    bounded = "ERROR: Incomplete response returned, reason: max_output_tokens"
    assert (result.returncode == 0 and not errors) or (errors and all(e == bounded for e in errors)), log[
        -3000:
    ]
    sent = proxy.bodies[0]
    kinds = {tool["type"] for tool in sent["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds
    assert sent["stream"] is True and sent["store"] is False
    assert "reasoning.encrypted_content" in sent["include"] and sent["prompt_cache_key"]
    # Codex bounds nothing; the server's default did (it is what kept the turn short).
    assert all("max_output_tokens" not in body for body in proxy.bodies)


def test_claude_code_print_completes_a_turn_over_messages(server, tmp_path: Path) -> None:
    claude = npm_cli("claude")
    with RecordingProxy(server.url) as proxy:
        env = {
            **os.environ,
            "ANTHROPIC_BASE_URL": proxy.url,
            "ANTHROPIC_API_KEY": API_KEY,
            "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"),
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "32",
            "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        result = subprocess.run(
            [
                str(claude),
                "-p",
                "Reply with the single word: hi",
                "--bare",
                "--model",
                MODEL,
                "--output-format",
                "json",
                "--system-prompt",
                "You are a terse assistant.",
                "--tools",
                "Read,Glob",
            ],
            env=env,
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
        )
    report = json.loads(result.stdout)
    # Every request was answered (no HTTP error); the turn ended as a turn ends, or at the
    # output bound Claude Code was given, never on a response it could not read.
    assert report.get("api_error_status") is None, report
    assert report["terminal_reason"] in ("completed", "success", "end_turn") or report.get("api_error") == (
        "max_output_tokens"
    ), report
    assert proxy.bodies and all(body["tools"] for body in proxy.bodies if body.get("max_tokens", 0) > 64)


@pytest.fixture
def agents_client(server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_runs_an_agent_with_a_function_tool(agents_client, api: str) -> None:
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
    )

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    model_class = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
    agent = Agent(
        name="weather",
        instructions="Use the get_weather tool to answer.",
        tools=[get_weather],
        model=model_class(model=MODEL, openai_client=agents_client),
        # A forced call (the server's grammar makes it a valid one) ends the run at the tool's result.
        # Greedy: sampled at temperature 1, the 135M model sometimes writes the rest of its answer
        # inside the city string (valid JSON) until max_tokens cuts the call (1 seed in 30).
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0.0
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=2))
    assert len(calls) == 1
    assert result.final_output == f"It is sunny in {calls[0]}."
