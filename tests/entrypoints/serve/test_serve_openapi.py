"""`/openapi.json` is true: schemathesis sends a bounded number of generated requests per operation to a real
`mrv2 serve` on 127.0.0.1, and every response must be documented (status, content type, body schema) and none a
5xx. The generated values stay inside the documented ranges, so a 400 here is a contradiction the schema cannot
express (a prompt longer than the model, ids outside the vocabulary), never a range it failed to document."""

from __future__ import annotations

import pytest
from helpers.serve_helpers import ServerProcess

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 6  # per operation: a bounded run (seconds on the random tiny model)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("model=random_tiny", "model.max_model_len=128", "serve.max_queued_requests=64") as s:
        yield s


def test_the_schema_documents_what_the_server_sends(server):
    schema = server.get("/openapi.json").json()
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            assert "422" not in op["responses"], (path, method)
            if method == "post":
                assert {"200", "400", "401", "404", "413", "503"} <= set(op["responses"]), (path, method)
                assert "$ref" in op["responses"]["200"]["content"]["application/json"]["schema"], path
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "content" not in schema["paths"]["/health"]["get"]["responses"]["200"]  # an empty 200
    top_p = schema["components"]["schemas"]["CompletionRequest"]["properties"]["top_p"]["anyOf"][0]
    assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0, 1)
    assert server.post("/v1/completions", json={"prompt": "x", "top_p": 0}).status_code == 400  # as documented


def test_generated_requests_get_documented_responses(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 15  # with /server_info, /model_info and their /get_ names
    for operation in operations:

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case) -> None:  # type: ignore[no-untyped-def]
            if case.body is not None and isinstance(case.body, dict):
                case.body["max_tokens"] = min(case.body.get("max_tokens") or 4, 4)  # bounded work per request
                case.body.pop("max_completion_tokens", None)
                case.body["max_output_tokens"] = min(case.body.get("max_output_tokens") or 4, 4)
            case.call_and_validate(checks=CHECKS, timeout=60)

        check()
