"""compose.yaml, checked without Docker: its structure, and every `rlmq ...` command it runs parses."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlmq.cli.main import build_parser

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*)|(:?\?)([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose's ``${VAR:-default}`` / ``${VAR:?message}`` / ``${VAR}``, with no variable set."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(3) if m.group(2) else "set-by-operator", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: interpolate(svc) for name, svc in compose["services"].items()}


def rlmq_commands(services: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    out = []
    for name, svc in services.items():
        for field in ("command", "entrypoint"):
            cmd = svc.get(field)
            if isinstance(cmd, str):
                cmd = cmd.split()
            if cmd and cmd[0] == "rlmq":
                out.append((name, [str(c) for c in cmd]))
    return out


def test_expected_services(services: dict[str, dict[str, Any]]) -> None:
    assert {"redis", "dashboard", "worker", "producer", "model"} <= set(services)
    profiles = {p for svc in services.values() for p in svc.get("profiles", [])}
    assert profiles & {"vllm", "llamacpp"}, "a profile for a real model server"
    for name, svc in services.items():
        if set(svc.get("profiles", [])) & {"vllm", "llamacpp"}:  # a model server's profile
            assert any(v.startswith(("${MODELS_DIR", "./models")) for v in _raw_volumes(name)), name


def _raw_volumes(name: str) -> list[str]:
    raw = yaml.safe_load(COMPOSE.read_text())["services"][name]
    return [str(v) for v in raw.get("volumes", [])]


def test_every_service_has_a_health_check(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        hc = svc.get("healthcheck")
        assert hc and hc.get("test") and not hc.get("disable"), f"{name} has no health check"
        assert hc["test"][0] in ("CMD", "CMD-SHELL"), name


def test_redis_states_its_persistence(services: dict[str, dict[str, Any]]) -> None:
    cmd = services["redis"]["command"]
    assert "--appendonly" in cmd and "--save" in cmd, "persistence settings are stated explicitly"
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"
    text = COMPOSE.read_text()
    assert re.search(r"#\s*Persistence:", text), "a comment says why"


def test_dashboard_has_auth_and_the_json_serializer(services: dict[str, dict[str, Any]]) -> None:
    d = services["dashboard"]
    cmd = d["command"]
    assert cmd[0] == "rq-dashboard" and ("--json" in cmd or "-j" in cmd)
    env = d.get("environment", {})
    has_user = "--username" in cmd or "RQ_DASHBOARD_USERNAME" in env
    has_password = "--password" in cmd or "RQ_DASHBOARD_PASSWORD" in env
    assert has_user and has_password, "basic auth"
    raw_env = yaml.safe_load(COMPOSE.read_text())["services"]["dashboard"]["environment"]
    assert ":?" in raw_env["RQ_DASHBOARD_PASSWORD"], "no default password: compose refuses to start without one"
    assert d["ports"] == ["127.0.0.1:9181:9181"]


def test_dashboard_flags_exist_in_rq_dashboard_0_9_0(services: dict[str, dict[str, Any]]) -> None:
    # rq-dashboard 0.9.0's click options (rq_dashboard/cli.py), checked by hand against the wheel
    known = {"-b", "--bind", "-p", "--port", "--url-prefix", "--username", "--password", "-c", "--config",
             "-u", "--redis-url", "--poll-interval", "--interval", "--extra-path", "--disable-delete", "--debug",
             "--normal", "-v", "--verbose", "-j", "--json", "--show-full-args"}  # fmt: skip
    flags = [c for c in services["dashboard"]["command"][1:] if c.startswith("-")]
    assert set(flags) <= known, set(flags) - known


def test_a_repl_host_states_the_privileges_it_needs(services: dict[str, dict[str, Any]]) -> None:
    w = services["repl-worker"]
    cmd = w["command"]
    assert int(cmd[cmd.index("--repl-slots") + 1]) >= 1 and "--allow-uncontained-repl" not in cmd
    assert w["profiles"] == ["rlm"] and "SYS_ADMIN" in w["cap_add"] and w["user"] == "0:0"
    assert "--repl-slots" not in services["worker"]["command"]


def test_worker_has_replicas(services: dict[str, dict[str, Any]]) -> None:
    w = services["worker"]
    assert int(w["deploy"]["replicas"]) >= 2
    assert "container_name" not in w, "a fixed container name breaks --scale"
    assert not w.get("ports"), "replicas cannot publish one host port"


def test_no_port_is_published_on_all_interfaces(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for port in svc.get("ports", []):
            if isinstance(port, dict):
                assert port.get("host_ip") == "127.0.0.1", (name, port)
                continue
            text = str(port)
            assert text.startswith("127.0.0.1:") and text.count(":") == 2, (name, text)
            assert "0.0.0.0" not in text


def test_depends_on_names_existing_services(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        for dep in deps if isinstance(deps, list) else deps.keys():
            assert dep in services, (name, dep)


def test_every_rlmq_command_parses_with_the_cli(services: dict[str, dict[str, Any]]) -> None:
    commands = rlmq_commands(services)
    subcommands = {argv[1] for _, argv in commands}
    assert {"worker", "run", "mock-llm"} <= subcommands
    parser = build_parser()
    for name, argv in commands:
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"service {name}: `{' '.join(argv)}` does not parse with rlmq's CLI")
        if args.command in ("worker", "run"):
            assert args.redis_url == "redis://redis:6379/0", name
    worker = next(argv for name, argv in commands if name == "worker")
    producer = next(argv for name, argv in commands if name == "producer")
    wa, pa = parser.parse_args(worker[1:]), parser.parse_args(producer[1:])
    assert wa.model == (pa.sub_model or pa.model), "producer and workers meet on the same queue"


def test_the_parser_would_catch_a_wrong_flag() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--model", "m", "--no-such-flag"])


def test_interpolation_helper() -> None:
    assert interpolate("${A:-x}/${B-y}/${C:?need C}/${D}") == "x/y/set-by-operator/set-by-operator"


def test_vllm_serves_tool_calls(services: dict[str, dict[str, Any]]) -> None:
    """The root model calls call_python_repl; vLLM returns tool calls only with these flags."""
    cmd = [str(c) for c in services["vllm"]["command"]]
    assert "--enable-auto-tool-choice" in cmd
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes"  # the default; VLLM_TOOL_PARSER overrides it
    assert "--jinja" in [str(c) for c in services["llamacpp"]["command"]]  # llama.cpp's tool calling
