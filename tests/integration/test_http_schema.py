"""The HTTP API against its own OpenAPI schema (FastAPI's ``/openapi.json``), with schemathesis:
for every operation, generated requests (valid and invalid) never get a 500, and every answer
(status code, content type, body, headers) is one the schema documents.

The server is a real one with no model loaded. Management calls are sent without the token,
so they are answered 401 before they could register, load or unload anything: their
schema is checked, the models are left alone. ``SPLITSERVE_TEST_SCHEMA_EXAMPLES`` raises the
example count for a longer run (benchmarks/README.md).
"""

from __future__ import annotations

import os

import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.helpers import start_server

EXAMPLES = int(os.environ.get("SPLITSERVE_TEST_SCHEMA_EXAMPLES", "8"))


def test_every_operation_answers_what_its_schema_says(tmp_path):
    s = start_server(tmp_path / "data", http=True)
    try:
        schema = schemathesis.openapi.from_url(f"{s.http}/openapi.json")
        failures: dict[str, str] = {}
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 20  # every route, not an empty schema
        for op in operations:

            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
            @given(case=op.as_strategy())
            def check(case: schemathesis.Case) -> None:
                case.call_and_validate(base_url=s.http)

            try:
                check()
            except Exception as e:  # noqa: BLE001 - every operation is checked, all failures reported
                failures[op.label] = str(e)
        assert not failures, "\n\n".join(f"{label}:\n{text}" for label, text in failures.items())
    finally:
        assert s.stop() == 0
