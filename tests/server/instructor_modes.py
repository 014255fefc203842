"""instructor against a deepinfer server, in every mode it offers for OpenAI-compatible servers.

Run by tests/server/test_instructor.py with the interpreter of instructor's own venv
(build/clients/instructor: its dependencies are not ours), so it imports nothing of deepinfer.
Prints one JSON line per mode: the object instructor returned, or its error.

    python instructor_modes.py BASE_URL API_KEY MODEL MODE...
"""

from __future__ import annotations

import json
import sys

import instructor
import openai
from pydantic import BaseModel, Field


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


# Two worked examples first: the default 135M model copies an answer's shape more readily than it
# follows instructor's prompt (left alone, JSON and MD_JSON echo the schema it is shown; after one
# example MD_JSON still did over an fp32 or bf16 KV cache, and passed over fp16 only).
EXAMPLE = [
    {"role": "user", "content": "Berlin is the capital of Germany. Extract the city."},
    {"role": "assistant", "content": '{"name": "Berlin", "country": "Germany"}'},
    {"role": "user", "content": "Rome is the capital of Italy. Extract the city."},
    {"role": "assistant", "content": '{"name": "Rome", "country": "Italy"}'},
]


def run(client: instructor.Instructor, model: str) -> City:
    return client.chat.completions.create(
        model=model,
        response_model=City,
        messages=[*EXAMPLE, {"role": "user", "content": "Paris is the capital of France. Extract the city."}],
        max_tokens=96,
        temperature=0,
        max_retries=2,
    )


def main() -> None:
    base_url, api_key, model, *modes = sys.argv[1:]
    oai = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    for mode in modes:
        client = instructor.from_openai(oai, mode=instructor.Mode[mode])
        try:
            city = run(client, model)
            print(json.dumps({"mode": mode, "object": city.model_dump()}), flush=True)
        except Exception as error:  # reported to the test, which names the mode that failed
            print(json.dumps({"mode": mode, "error": f"{type(error).__name__}: {error}"}), flush=True)


if __name__ == "__main__":
    main()
