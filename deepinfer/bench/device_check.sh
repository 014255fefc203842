#!/usr/bin/env bash
# The GPU path's one prepared check, for a CUDA machine without network (an H200 with Python 3.12,
# torch 2.11, Triton 3.6, CUDA 13). From the repository root:
#
#     bash deepinfer/bench/device_check.sh [OUT_JSON]        # default: build/device_check.json
#
# 1. the environment (python, torch, triton, the GPU);
# 2. tests/triton compiled for the GPU (DEEPINFER_TEST_DEVICE=cuda: the kernels against their
#    torch references, the tiny decode bench, and the engine test when its dependencies are there);
# 3. deepinfer/bench/device_decode.py: decode steps of a Llama-3.1-8B-shaped bf16 model built from random
#    values, batch 1, 64 and 256, eager and as a CUDA graph, against the HBM roofline;
# 4. deepinfer/bench/engine_decode.py: the engine's own decode step (ModelRunner.run) of a
#    Llama-3.2-1B-shaped model, batch 1 and 16, with its decode CUDA graphs and --enforce-eager;
# 5. deepinfer/bench/v4_decode_step.py on the Triton backend: a small DeepSeek-V4-shaped model's
#    decode step (sparse attention, fused MoE) against a V3 MLA model's, from 1k to 64k context.
# Each step has its own time limit and is recorded whatever the others do; everything lands in one
# JSON. pytest is needed for step 2: when the machine lacks it (or llguidance, which the sampler
# test imports), put their wheels in $DEEPINFER_WHEELS (default build/wheels), e.g. here with
#     pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#         -d build/wheels pytest llguidance
# and they are installed from there (--no-index). Exit status 0 when every step passed.
set -u
cd "$(dirname "$0")/../.."
OUT=${1:-build/device_check.json}
PY=${PYTHON:-python3}
WHEELS=${DEEPINFER_WHEELS:-build/wheels}
WORK=$(mktemp -d)
mkdir -p "$(dirname "$OUT")"
START=$(date +%s)
# The whole run stays under 9.5 minutes (a device session's call is 10): each step gets its own
# limit or what is left of the run's minus what the later steps keep (the second argument),
# whichever is less.
DEADLINE=$((START + ${DEEPINFER_CHECK_SECONDS:-570}))
limit() { local left=$((DEADLINE - $(date +%s) - ${2:-0})); [ "$left" -lt "$1" ] && echo $((left > 10 ? left : 10)) || echo "$1"; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== environment"
timeout "$(limit 60)" "$PY" - >"$WORK/env.json" 2>"$WORK/env.err" <<'EOF'
import json, platform, sys
info = {"python": platform.python_version()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
except Exception as exc:  # recorded, not fatal: the later steps record their own failures
    info["torch_error"] = repr(exc)
try:
    import triton
    info["triton"] = triton.__version__
except Exception as exc:
    info["triton_error"] = repr(exc)
json.dump(info, sys.stdout)
EOF
echo "env rc=$?"; cat "$WORK/env.json"; echo

if ! "$PY" -c "import pytest, llguidance" 2>/dev/null && [ -d "$WHEELS" ]; then
    echo "== installing test wheels from $WHEELS"
    timeout "$(limit 90)" "$PY" -m pip install -q --no-index --find-links "$WHEELS" pytest llguidance \
        || timeout "$(limit 90)" "$PY" -m pip install -q --no-index --find-links "$WHEELS" pytest
fi

echo "== tests/triton on CUDA"
# Kernels compile on first use: up to 270 s, keeping 300 s for the three decode steps.
DEEPINFER_TEST_DEVICE=cuda timeout "$(limit 270 300)" "$PY" -m pytest tests/triton -q -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$WORK/tests.xml" >"$WORK/tests.log" 2>&1
TESTS_RC=$?
tail -n 40 "$WORK/tests.log"

echo "== decode of a Llama-3.1-8B-shaped bf16 model"
timeout "$(limit 150 150)" "$PY" -m deepinfer.bench.device_decode --out "$WORK/decode.json" >"$WORK/decode.log" 2>&1
DECODE_RC=$?
tail -n 20 "$WORK/decode.log"

echo "== the engine's decode, CUDA graphs on and off"
# The engine imports more than torch and triton (numpy, cryptography, ...): without them this
# step is skipped, said in its log, rather than failed.
if "$PY" -c "import deepinfer.runner.model_runner" 2>"$WORK/engine.log"; then
    timeout "$(limit 90 60)" "$PY" -m deepinfer.bench.engine_decode --out "$WORK/engine.json" >"$WORK/engine.log" 2>&1
    ENGINE_RC=$?
else
    echo "skipped: the engine's dependencies are missing" >>"$WORK/engine.log"
    ENGINE_RC=0
fi
tail -n 20 "$WORK/engine.log"

echo "== DeepSeek-V4 and V3 decode steps against context, Triton backend"
timeout "$(limit 60)" "$PY" -m deepinfer.bench.v4_decode_step --device cuda --attention-backend triton \
    --contexts 1024,4096,16384,65536 --repeats 3 --out "$WORK/v4.json" >"$WORK/v4.log" 2>&1
V4_RC=$?
tail -n 12 "$WORK/v4.log"

"$PY" - "$WORK" "$OUT" "$TESTS_RC" "$DECODE_RC" "$START" "$ENGINE_RC" "$V4_RC" <<'EOF'
import json, os, sys, time
import xml.etree.ElementTree as ET

work, out, tests_rc, decode_rc, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
engine_rc, v4_rc = int(sys.argv[6]), int(sys.argv[7])


def read(name):
    try:
        with open(os.path.join(work, name)) as f:
            return f.read()
    except OSError:
        return ""


def tests_summary():
    summary = {"rc": tests_rc, "log_tail": read("tests.log")[-4000:]}
    try:
        root = ET.parse(os.path.join(work, "tests.xml")).getroot()
    except (OSError, ET.ParseError) as exc:
        summary["junit_error"] = repr(exc)
        return summary
    cases = []
    for case in root.iter("testcase"):
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            if case.find(kind) is not None:
                outcome = kind
        cases.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0)})
    summary["counts"] = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    summary["not_passed"] = [c for c in cases if c["outcome"] != "passed"]
    return summary


decode = {"rc": decode_rc, "log_tail": read("decode.log")[-4000:]}
try:
    decode["report"] = json.loads(read("decode.json"))
except ValueError:
    pass
try:
    env = json.loads(read("env.json"))
except ValueError:
    env = {"error": read("env.err")[-2000:]}
engine = {"rc": engine_rc, "log_tail": read("engine.log")[-4000:]}
try:
    engine["report"] = json.loads(read("engine.json"))
except ValueError:
    pass
v4 = {"rc": v4_rc, "log_tail": read("v4.log")[-4000:]}
try:
    v4["report"] = json.loads(read("v4.json"))
except ValueError:
    pass
report = {"env": env, "tests": tests_summary(), "decode": decode, "engine_decode": engine,
          "v4_decode_step": v4, "elapsed_s": round(time.time() - start, 1)}
report["ok"] = tests_rc == 0 and decode_rc == 0 and engine_rc == 0 and v4_rc == 0
with open(out, "w") as f:
    json.dump(report, f, indent=2)
print(f"wrote {out}: ok={report['ok']} in {report['elapsed_s']} s")
EOF
rm -rf "$WORK"
[ "$TESTS_RC" -eq 0 ] && [ "$DECODE_RC" -eq 0 ] && [ "$ENGINE_RC" -eq 0 ] && [ "$V4_RC" -eq 0 ]
