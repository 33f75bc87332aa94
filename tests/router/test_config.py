"""Router settings: flags and environment parse alike; every bad value names its flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from e2e.vllm_server import REPO, base_env
from encoderpool_router.config import RouterSettings, build_parser, parse_settings


def test_flags_parse_into_settings() -> None:
    s = parse_settings(
        ["--producers", "http://127.0.0.1:8001/, http://127.0.0.1:8002", "--consumers",
         "http://127.0.0.1:8003", "--producer-timeout-s", "2.5", "--consumer-retries", "0"]
    )  # fmt: skip
    assert s.producers == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert s.consumers == ("http://127.0.0.1:8003",)
    assert s.producer_timeout_s == 2.5
    assert s.consumer_retries == 0
    assert not s.discovery


def test_environment_is_read_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENCODERPOOL_ROUTER_PRODUCER_SERVICE", "pool-producers")
    monkeypatch.setenv("ENCODERPOOL_ROUTER_CONSUMER_SERVICE", "pool-consumers")
    monkeypatch.setenv("ENCODERPOOL_ROUTER_NAMESPACE", "ml")
    monkeypatch.setenv("ENCODERPOOL_ROUTER_PORT", "9000")
    s = parse_settings(["--port", "9100"])
    assert s.discovery
    assert (s.producer_service, s.consumer_service, s.namespace) == (
        "pool-producers",
        "pool-consumers",
        "ml",
    )
    assert s.port == 9100


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no backends: give --consumers"),
        (["--producers", "http://127.0.0.1:1"], "--consumers is empty"),
        (["--consumers", "ftp://h:1"],
         "--consumers (ENCODERPOOL_ROUTER_CONSUMERS): 'ftp://h:1' is not a base URL"),
        (["--consumers", "http://h:1/v1"], "must not carry a path"),
        (["--consumers", "http://h:99999"], "has an invalid port"),
        (["--consumers", "http://h:1,http://h:1"], "lists a backend twice"),
        (["--consumers", "http://h:1", "--consumer-service", "c"], "not both"),
        (["--producer-service", "p"], "give both --producer-service and --consumer-service"),
        (["--producer-service", "Pool_P", "--consumer-service", "c"],
         "--producer-service (ENCODERPOOL_ROUTER_PRODUCER_SERVICE): 'Pool_P' is not a Service"),
        (["--producer-service", "p", "--consumer-service", "c", "--namespace", "NS!"],
         "not a namespace name"),
        (["--consumers", "http://h:1", "--port", "0"],
         "--port (ENCODERPOOL_ROUTER_PORT): Input should be greater than or equal to 1"),
        (["--consumers", "http://h:1", "--producer-timeout-s", "0"], "--producer-timeout-s"),
        (["--consumers", "http://h:1", "--consumer-retries", "4"], "--consumer-retries"),
        (["--consumers", "http://h:1", "--producer-load-bound", "x"], "--producer-load-bound"),
        (["--consumers", "http://h:1", "--log-level", "LOUD"], "--log-level"),
        (["--consumers", "http://h:1", "--metrics-port", "8000"],
         "--port 8000, --metrics-port 8000, --probe-port 8081: give three different ports"),
        (["--consumers", "http://h:1", "--probe-port", "9090"],
         "--probe-port 9090: give three different ports"),
        (["--consumers", "http://h:1", "--memory-limit-bytes", str(300 << 20)],
         "leaves no room for clients"),
        (["--consumers", "http://h:1", "--max-connections", "100000"],
         "--max-connections (100000) x"),
        (["--consumers", "http://h:1", "--max-body-bytes", str(1 << 30)],
         "--max-body-bytes (1024 MiB) costs up to 2048 MiB once parsed"),
        (["--consumers", "http://h:1", "--body-memory-bytes", str(100 << 20),
          "--body-memory-per-client-bytes", str(200 << 20)],
         "--body-memory-per-client-bytes (200 MiB) is over --body-memory-bytes (100 MiB)"),
        (["--consumers", "http://h:1", "--backend-api-key", " k "],
         "--backend-api-key (ENCODERPOOL_ROUTER_BACKEND_API_KEY): must be a non-empty key"),
    ],
)  # fmt: skip
def test_each_bad_value_is_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match="invalid router settings") as e:
        parse_settings(argv)
    assert message in str(e.value)


def test_settings_are_frozen_and_reject_unknown_fields() -> None:
    s = RouterSettings(consumers=("http://h:1",))
    with pytest.raises(ValueError, match="frozen"):
        s.port = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        RouterSettings(consumers=("http://h:1",), consumer="x")  # type: ignore[call-arg]


def test_the_entry_point_exits_2_with_the_message() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "encoderpool_router", "--consumers", "nope"],
        env=base_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "--consumers (ENCODERPOOL_ROUTER_CONSUMERS): 'nope' is not a base URL" in res.stderr


def test_the_backend_key_comes_from_the_environment_and_is_never_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ENCODERPOOL_ROUTER_BACKEND_API_KEY", "s3cret-backend-key")
    s = parse_settings(["--consumers", "http://h:1"])
    assert s.backend_api_key is not None
    assert s.backend_api_key.get_secret_value() == "s3cret-backend-key"
    assert "s3cret" not in repr(s) + str(s)
    monkeypatch.setenv("ENCODERPOOL_ROUTER_BACKEND_API_KEY", "")  # an empty Secret key
    with pytest.raises(ValueError, match="must be a non-empty key") as e:
        parse_settings(["--consumers", "http://h:1"])
    assert "s3cret" not in str(e.value)


@pytest.mark.parametrize("content", [None, "\n  \n"], ids=["missing", "no-token"])
def test_an_unusable_token_file_stops_start_up(tmp_path: Path, content: str | None) -> None:
    tokens = tmp_path / "tokens"
    if content is not None:
        tokens.write_text(content)
    res = subprocess.run(
        [sys.executable, "-m", "encoderpool_router", "--consumers", "http://127.0.0.1:1",
         "--auth-token-file", str(tokens)],
        env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2
    assert f"client token file {tokens}" in res.stderr


def test_the_router_imports_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, encoderpool_router.__main__, encoderpool_router.app;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=base_env(), cwd=REPO, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr


def test_help_lists_every_flag() -> None:
    text = build_parser().format_help()  # a stray % in a description would raise here
    assert all(f"--{n.replace('_', '-')}" in text for n in RouterSettings.model_fields)
