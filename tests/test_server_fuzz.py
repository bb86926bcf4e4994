"""The server against its own OpenAPI document, fuzzed by schemathesis.

schemathesis reads /openapi.json and sends requests generated from it: valid
ones (positive) and ones that break the schema on purpose (negative). The run
fails on any 5xx, on a status, content type or JSON body the document does not
list, and on a schema-violating request the server accepts (the document would
then be stricter than the server). /health must still answer 200 afterwards:
a request that killed the engine (as an int64-overflowing seed once did) turns
every later answer into a 503 the document does not promise.

The server is bounded so that no generated request asks for much work
(max_model_len 128, n <= 4 through MINI_VLLM_MAX_N_SEQUENCES, both stated in
the document), and the run is bounded in requests (EXAMPLES per operation and
phase, fixed seed) and in time (a hang guard)."""
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server_utils import Server

EXAMPLES = 25
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "negative_data_rejection")


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "128", env={"MINI_VLLM_MAX_N_SEQUENCES": "4"})
    yield s
    s.stop()


def test_openapi_document_tells_the_truth_under_fuzzing(server, tmp_path):
    st = Path(sys.executable).with_name("st")
    cmd = [str(st), "run", f"{server.url}/openapi.json", "--checks", CHECKS, "--max-examples", str(EXAMPLES),
           "--seed", "1", "--workers", "1", "--no-color", "--request-timeout", "60", "--generation-database",
           "none", "--report", "junit", "--report-dir", str(tmp_path)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=tmp_path)  # a hang guard
    except subprocess.TimeoutExpired:
        pytest.fail(f"the fuzz run did not end within 1800 s; server log: {server.log()}")
    out = run.stdout + run.stderr
    summary = re.search(r"(\d+) generated, .*", out)
    print(f"schemathesis: {summary.group(0) if summary else 'no summary'}")
    assert run.returncode == 0, f"the fuzzer found a mismatch or a server error:\n{out[-6000:]}"
    assert summary and int(summary.group(1)) >= 8 * EXAMPLES, f"too few requests were generated: {out[-2000:]}"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200, \
        f"the engine died under fuzzing: {server.log()}"
    assert "engine thread died" not in server.log(), f"a generated request killed the engine: {server.log()}"


def test_openapi_document_states_what_the_server_does(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    statuses = {(p, m): set(op["responses"]) for p, ops in doc["paths"].items() for m, op in ops.items()}
    assert not [k for k, v in statuses.items() if "422" in v], "FastAPI's 422 is documented; the server answers 400"
    assert "400" in statuses[("/v1/completions", "post")] and "503" in statuses[("/v1/completions", "post")]
    health = doc["paths"]["/health"]["get"]["responses"]
    assert set(health) == {"200", "503"} and not any("content" in r for r in health.values()), \
        "/health answers 200 or 503 without a body"
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    prompt = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert all(m.get("minLength") == 1 or m.get("minItems") == 1 for m in prompt), \
        f"the document allows an empty prompt, which the server rejects: {prompt}"
    seed = doc["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (-(2 ** 63), 2 ** 63 - 1), f"seed's int64 range: {seed}"
    mt = doc["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert mt["maximum"] == 128, f"max_tokens must be bounded by this server's max_model_len: {mt}"
