"""Malformed requests get a 4xx with an OpenAI error body from the router and the emulator, never a 500."""

from __future__ import annotations

import http.client
import json

import pytest

pytest.importorskip("aiohttp")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from twin.router.keys import KeysFile  # noqa: E402
from twin.router.local import LocalFleet  # noqa: E402
from twin.router.service import RouterServiceConfig  # noqa: E402

KEY = "sk-fuzz-tenant-0001"
MAX_MODEL_LEN = 512
MAX_BODY = 64 * 1024
VALID_COMPLETION = {"model": "twin-model", "prompt": [1, 2, 3, 4], "max_tokens": 4}
VALID_CHAT = {"model": "twin-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def fleet():
    f = LocalFleet(n=1, policy={"kind": "least_outstanding_tokens"},
                   keys=KeysFile.model_validate({"keys": {KEY: {"tenant": "fuzz"}}}),
                   config=RouterServiceConfig(max_model_len=MAX_MODEL_LEN, max_body_bytes=MAX_BODY),
                   profile="llama3-8b-bf16-tp1-h100",
                   engine_overrides={"max_model_len": MAX_MODEL_LEN, "num_gpu_blocks": 512})
    f.emulators[0].max_body_bytes = MAX_BODY
    yield f
    f.close()


def post(port: int, path: str, data: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30.0)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json",
                                                       "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def check_4xx(status: int, body: bytes) -> None:
    assert 400 <= status < 500, (status, body[:300])
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "code" in err


# Values that are the wrong JSON type for every field they are put in below.
not_int = st.one_of(st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none(),
                    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
bad_max_tokens = st.one_of(not_int.filter(lambda v: v is not None), st.integers(max_value=0),
                           st.integers(min_value=MAX_MODEL_LEN, max_value=10**30))
bad_prompt = st.one_of(
    st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(), st.just(""), st.just([]),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.integers(max_value=-1), min_size=1, max_size=4),  # negative token ids
    st.lists(st.text(max_size=3), min_size=1, max_size=3),  # batches of strings are not supported
    st.lists(st.integers(min_value=0, max_value=100), min_size=MAX_MODEL_LEN, max_size=MAX_MODEL_LEN + 50),  # too long
)
bad_messages = st.one_of(
    st.just([]), st.text(max_size=5), st.integers(), st.none(),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"])}), min_size=1, max_size=2),
    st.lists(st.fixed_dictionaries({"role": st.text(max_size=4).filter(
        lambda r: r not in ("system", "developer", "user", "assistant", "tool")), "content": st.text(max_size=4)}),
        min_size=1, max_size=2),
    st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": not_int.filter(
        lambda v: not isinstance(v, str) and v != [])}), min_size=1, max_size=2),
)


@st.composite
def malformed_body(draw) -> tuple[str, bytes]:
    how = draw(st.sampled_from(["field", "missing", "not_object", "not_json"]))
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = dict(VALID_CHAT if chat else VALID_COMPLETION)
    if how == "not_json":
        raw = draw(st.binary(max_size=64))
        try:
            value = json.loads(raw)
        except ValueError:
            return path, raw
        return path, json.dumps([value]).encode()  # valid JSON but not an object
    if how == "not_object":
        value = draw(st.one_of(st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3), st.none()))
        return path, json.dumps(value).encode()
    if how == "missing":
        body.pop("messages" if chat else "prompt")
        return path, json.dumps(body).encode()
    field = draw(st.sampled_from(["max_tokens", "stream", "temperature", "n", "model", "main"]))
    if field == "max_tokens":
        body["max_tokens"] = draw(bad_max_tokens)
    elif field == "stream":
        body["stream"] = draw(not_int.filter(lambda v: not isinstance(v, bool) and v is not None) | st.integers())
    elif field == "temperature":
        body["temperature"] = draw(st.one_of(st.text(max_size=3), st.floats(min_value=2.01, max_value=1e9),
                                             st.floats(max_value=-0.01, min_value=-1e9), st.booleans()))
    elif field == "n":
        body["n"] = draw(st.integers().filter(lambda v: v != 1))
    elif field == "model":
        body["model"] = draw(st.one_of(st.integers(), st.lists(st.text(max_size=2), min_size=1, max_size=2)))
    elif chat:
        body["messages"] = draw(bad_messages)
    else:
        body["prompt"] = draw(bad_prompt)
    return path, json.dumps(body).encode()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=malformed_body())
def test_malformed_requests_get_a_4xx_openai_error(fleet, case) -> None:
    path, raw = case
    check_4xx(*post(fleet.router_port, path, raw))
    check_4xx(*post(fleet.emulator_ports[0], path, raw))


def test_fuzz_cases_are_malformed_only_by_their_mutation(fleet) -> None:
    """The valid bases pass through, so a 4xx above is caused by the mutation."""
    for path, body in (("/v1/completions", VALID_COMPLETION), ("/v1/chat/completions", VALID_CHAT)):
        status, raw = post(fleet.router_port, path, json.dumps(body).encode())
        assert status == 200, raw


def test_oversized_body_is_413(fleet) -> None:
    raw = json.dumps({"prompt": "x" * (MAX_BODY + 1000), "max_tokens": 2}).encode()
    for port in (fleet.router_port, fleet.emulator_ports[0]):
        status, body = post(port, "/v1/completions", raw)
        check_4xx(status, body)
        assert status == 413


def test_prompt_over_the_context_limit_is_400(fleet) -> None:
    for prompt in (list(range(MAX_MODEL_LEN)), "abcd" * MAX_MODEL_LEN):
        status, body = post(fleet.router_port, "/v1/completions", json.dumps({"prompt": prompt}).encode())
        check_4xx(status, body)
        assert "context length" in json.loads(body)["error"]["message"]


def test_router_still_serves_after_the_fuzz(fleet) -> None:
    assert fleet.router.in_flight == 0
    status, raw = post(fleet.router_port, "/v1/completions", json.dumps(VALID_COMPLETION | {"stream": False}).encode())
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
