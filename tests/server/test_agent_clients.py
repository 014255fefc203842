"""Real agent clients against the real `deepinfer serve` (the default model): Codex CLI over
/v1/responses, Claude Code over /v1/messages, the openai-agents SDK over both OpenAI APIs.

A 135M model does no useful agent work; what is checked is that each client accepts every
response and event the server sends and ends its turn without a protocol error, and that the
server answered none of the session's requests with a status >= 400 (its access log). The
npm CLIs come from `make agent-clients` (build/npm); without npm they are skipped, saying so.

The clients run as users run them: Codex with its own instructions (about 9,200 tokens with its
tools) and Claude Code in its default mode (not `--bare`: its environment block comes as a
`system` entry inside `messages`). Codex's prompt is longer than SmolLM2's trained context of
8,192 tokens, so the server runs with the README's long-context flags (YaRN RoPE scaling x4,
`--max-model-len 32768`). Output is bounded so each turn stays short: Claude Code asks for
32,000 tokens unless told otherwise, and Codex sends no bound at all (so it samples to the end
of the context unless the server has `--default-max-tokens`, as an agent deployment would).
On the default model Claude Code is given two tools (`--tools Read,Glob`): its whole default set
is ~12,600 prompt tokens, minutes of prefill on a 2-core CPU. Its whole default set runs against
a tiny random model with SmolLM2's tokenizer and chat template (tiny_smollm.py), whose prefill
takes seconds, with keep-alive pings every 0.1 s: the protocol path of a long prefill, end to end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL
from tests.server.server_process import ServerProcess, wait_until
from tests.server.tiny_smollm import CONTEXT as TINY_CONTEXT
from tests.server.tiny_smollm import write_tiny_smollm

pytestmark = [pytest.mark.slow, pytest.mark.agents]

NPM_BIN = Path(__file__).resolve().parents[2] / "build" / "npm" / "node_modules" / ".bin"
CLIENT_TIMEOUT_S = 540
DEFAULT_MAX_TOKENS = 128
TRAINED_CONTEXT = 8192
# The README's flags for agent CLIs on the default model (its "Agent clients" section).
LONG_CONTEXT = (
    "--rope-scaling",
    '{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":8192}',
    "--max-model-len",
    "32768",
)
# uvicorn's access log line: `127.0.0.1:5000 - "POST /v1/messages?beta=true HTTP/1.1" 200 OK`
_ACCESS = re.compile(r'"([A-Z]+ \S+) HTTP/[\d.]+" (\d{3})')


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(
        "--api-key",
        API_KEY,
        "--default-max-tokens",
        str(DEFAULT_MAX_TOKENS),
        *LONG_CONTEXT,
        "--kv-cache-memory",
        "1GiB",  # the 16-bit cache of ~46,000 tokens: a 9k-token session and its retries
        "--log-level",
        "info",  # the access log: every response's status
    ).start()
    yield process
    assert process.stop() == 0, process.log_tail()


def responses_since(server: ServerProcess, first_line: int) -> list[tuple[str, int]]:
    """(request line, status) of every response the server logged from `first_line` on."""
    found = (_ACCESS.search(line) for line in server.lines[first_line:])
    return [(match.group(1), int(match.group(2))) for match in found if match]


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
        self.pings = 0  # Messages `ping` events relayed to the client
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
                    relayed = bytearray()
                    for chunk in upstream.iter_raw():
                        relayed += chunk
                        self.wfile.write(chunk)
                        self.wfile.flush()
                proxy.pings += relayed.count(b"event: ping\n")

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


def test_the_flags_stretch_the_context_to_32768_tokens(server) -> None:
    # Serving past 8,192 tokens is what the Codex test below does (its prompt is ~9,200 tokens; a
    # prefill of that length is a minute of this CPU), and tests/engine/test_rope_scaling_option.py
    # checks the scaled model against HF transformers'. Here: the limit the server now enforces.
    prompt = "".join(
        f"Note {i}: the parcel for desk {i * 7 % 101} left at {i % 24:02d}:00.\n" for i in range(1488)
    )
    with server.client(API_KEY) as http:
        first_line = len(server.lines)
        card = http.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == 32768
        count = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
        assert count > 32768
        too_long = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert too_long.status_code == 400 and "32768" in too_long.text, too_long.text
    # The access log reaches server.lines through a reader thread: the last line may lag its response.
    assert wait_until(lambda: len(responses_since(server, first_line)) >= 3, 10.0), server.log_tail()
    assert [status for _, status in responses_since(server, first_line)] == [200, 200, 400]


def test_codex_exec_with_its_own_instructions_completes_a_turn_over_responses(server, tmp_path: Path) -> None:
    codex = npm_cli("codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    first_line = len(server.lines)
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
    answered = responses_since(server, first_line)
    assert answered and all(status < 400 for _, status in answered), answered
    sent = proxy.bodies[0]
    kinds = {tool["type"] for tool in sent["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds
    assert sent["stream"] is True and sent["store"] is False
    assert "reasoning.encrypted_content" in sent["include"] and sent["prompt_cache_key"]
    # Codex bounds nothing; the server's default did (it is what kept the turn short).
    assert all("max_output_tokens" not in body for body in proxy.bodies)
    # Its own instructions make a prompt past the model's trained context: served by the flags.
    with server.client(API_KEY) as http:
        count = http.post("/tokenize", json=sent).json()["count"]
    assert count > TRAINED_CONTEXT, count


def run_claude_code(
    server: ServerProcess, tmp_path: Path, *options: str
) -> tuple[dict[str, Any], RecordingProxy]:
    """One `claude -p` turn through a RecordingProxy; its JSON report. Every request was answered
    (no HTTP error, none logged >= 400); the turn ended as a turn ends, or at the output bound
    Claude Code was given, never on a response it could not read."""
    claude = npm_cli("claude")
    first_line = len(server.lines)
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
                "--model",
                MODEL,
                "--output-format",
                "json",
                *options,
            ],
            env=env,
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
        )
    report = json.loads(result.stdout)
    assert report.get("api_error_status") is None, report
    assert report["terminal_reason"] in ("completed", "success", "end_turn") or report.get("api_error") == (
        "max_output_tokens"
    ), report
    answered = responses_since(server, first_line)
    assert answered and all(status < 400 for _, status in answered), answered
    assert proxy.bodies and all(body["tools"] for body in proxy.bodies if body.get("max_tokens", 0) > 64)
    # The default mode: its own system prompt, and its environment as a system entry in `messages`.
    first = proxy.bodies[0]
    assert first["system"] and any(message["role"] == "system" for message in first["messages"])
    return report, proxy


def test_claude_code_in_its_default_mode_completes_a_turn_over_messages(server, tmp_path: Path) -> None:
    run_claude_code(server, tmp_path, "--tools", "Read,Glob")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """The tiny random SmolLM2 (tiny_smollm.py) served as the default model's name, with a
    keep-alive interval far shorter than its prefills."""
    model = write_tiny_smollm(tmp_path_factory.mktemp("tiny-smollm"))
    process = ServerProcess(
        str(model),
        "--served-model-name",
        MODEL,
        "--api-key",
        API_KEY,
        "--default-max-tokens",
        str(DEFAULT_MAX_TOKENS),
        "--max-model-len",
        str(TINY_CONTEXT),
        "--stream-keepalive",
        "0.1",
        "--log-level",
        "info",
    ).start()
    yield process
    assert process.stop() == 0, process.log_tail()


def test_claude_code_with_its_whole_default_tool_set_completes_a_turn(tiny_server, tmp_path: Path) -> None:
    # No --tools, no --bare: every tool Claude Code declares, a prompt SmolLM2 prefills for minutes
    # here (the tiny model: seconds). Its streams carried keep-alive pings, which it ignored.
    _, proxy = run_claude_code(tiny_server, tmp_path)
    names = {tool["name"] for tool in proxy.bodies[0]["tools"]}
    assert {"Agent", "Bash", "Edit", "Read"} <= names, names
    with tiny_server.client(API_KEY) as http:
        count = http.post("/v1/messages/count_tokens", json=proxy.bodies[0]).json()["input_tokens"]
    assert count > 10_000, count
    assert proxy.pings > 0


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
