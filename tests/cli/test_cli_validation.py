"""Bad flags, LOCALLLM_* variables and config.toml values are usage errors: exit status 2, one line that
names the setting and what is allowed, no traceback, and nothing started or loaded first.

In-process tests (CliRunner) replace uvicorn.run, create_app, Engine and the bench entry points with
recorders, so a value that slipped through shows up as "started" instead of starting anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from localllm.cli import cli


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What would have started: the server (create_app, uvicorn.run), an engine, a bench."""
    import uvicorn

    import localllm.cli.bench as cli_bench
    import localllm.runtime.engine.scheduler as engine_mod
    import localllm.server.app as app_mod

    calls: list[str] = []

    def recorder(what: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            calls.append(what)
            raise RuntimeError(f"{what} was reached")

        return record

    monkeypatch.setattr(uvicorn, "run", recorder("uvicorn.run"))
    monkeypatch.setattr(app_mod, "create_app", recorder("create_app"))
    monkeypatch.setattr(engine_mod, "Engine", recorder("Engine"))
    monkeypatch.setattr(cli_bench, "resolve_model", recorder("bench"))
    return calls


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


def assert_usage_error(res: Result, *needles: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, res.output
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def write_config(home: Path, text: str) -> Path:
    cfg = home / "config" / "config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(text, encoding="utf-8")
    return cfg


# ---- flags ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "flag", "allowed"), [
    (["--port", "99999"], "--port", "1 to 65535"),
    (["--port", "-1"], "--port", "1 to 65535"),
    (["--port", "0"], "--port", "1 to 65535"),
    (["--port", "http"], "--port", "1 to 65535"),
    (["--draft-max", "-5"], "--draft-max", "0 to 64"),
    (["--draft-max", "65"], "--draft-max", "0 to 64"),
    (["--host", "not a host"], "--host", "host name or an IP address"),
    (["--host", "127.0.0.1:8080"], "--host", "host name or an IP address"),
    (["--host", "999.1.2.3"], "--host", "host name or an IP address"),
])
def test_serve_bad_flags(args: list[str], flag: str, allowed: str, started: list[str]) -> None:
    assert_usage_error(invoke("serve", *args), f"'{flag}'", allowed)
    assert started == []


@pytest.mark.parametrize(("args", "flag", "allowed"), [
    (["--temperature", "nan"], "--temperature", "finite"),
    (["--temperature", "inf"], "--temperature", "finite"),
    (["--temperature", "-inf"], "--temperature", "finite"),
    (["--temperature", "-1"], "--temperature", "x>=0"),
    (["--draft-max", "-1", "--lookup"], "--draft-max", "0 to 64"),
    (["--draft-max", "65", "--lookup"], "--draft-max", "0 to 64"),
    (["--slots", "0"], "--slots", "1 to 256"),
    (["--slots", "257"], "--slots", "1 to 256"),
    (["--ctx", "0"], "--ctx", "1 to 1048576"),
    (["--ctx", "99999999999"], "--ctx", "1 to 1048576"),
    (["--threads", "0"], "--threads", "1 to 1024"),
    (["--threads", "99999"], "--threads", "1 to 1024"),
    (["--gpu-layers", "-5"], "--gpu-layers", ">= -1"),
    (["--kv-type", "q9"], "--kv-type", "f16"),
])
def test_run_bad_flags_refused_before_loading(args: list[str], flag: str, allowed: str, started: list[str],
                                              tiny_path: Path) -> None:
    res = invoke("run", str(tiny_path), "hi", "--max-tokens", "2", *args)
    assert_usage_error(res, f"'{flag}'", allowed)
    assert started == []


@pytest.mark.parametrize(("args", "flag"), [
    (["--fuzz", "nan"], "--fuzz"), (["--fuzz", "-1"], "--fuzz"), (["--fuzz", "inf"], "--fuzz"),
    (["--fuzz", "0"], "--fuzz"), (["--soak", "inf", "--http"], "--soak"), (["--soak", "-3"], "--soak"),
    (["--http", "--clients", "0,4"], "--clients"), (["--http", "--clients", "four"], "--clients"),
    (["--http", "--clients", ","], "--clients"), (["--gen", "0"], "--gen"), (["--tokens", "-1"], "--tokens"),
    (["--ctx", "0"], "--ctx"), (["--threads", "-2"], "--threads"), (["--spec", "--draft-max", "-1"], "--draft-max"),
])
def test_bench_bad_flags(args: list[str], flag: str, started: list[str]) -> None:
    assert_usage_error(invoke("bench", "whatever:1b", *args), f"'{flag}'")
    assert started == []


def test_chat_bad_ctx(started: list[str]) -> None:
    assert_usage_error(invoke("chat", "--ctx", "-4"), "'--ctx'", "1 to 1048576")
    assert started == []


# ---- environment ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("var", "value", "allowed"), [
    ("LOCALLLM_HOST", "127.0.0.1:abc", "1 to 65535"),
    ("LOCALLLM_HOST", "127.0.0.1:99999", "1 to 65535"),
    ("LOCALLLM_HOST", "127.0.0.1:", "1 to 65535"),
    ("LOCALLLM_HOST", "bad host:8080", "host name or an IP address"),
    ("LOCALLLM_HOST", "[::1", "host"),
    ("LOCALLLM_PORT", "-1", "1 to 65535"),
    ("LOCALLLM_PORT", "eighty", "1 to 65535"),
    ("LOCALLLM_SLOTS", "0", "1 to 256"),
    ("LOCALLLM_THREADS", "-3", "1 to 1024"),
    ("LOCALLLM_CTX", "lots", "1 to 1048576"),
    ("LOCALLLM_DRAFT_MAX", "-5", "0 to 64"),
    ("LOCALLLM_LOOKUP", "maybe", "true or false"),
    ("LOCALLLM_KEEP_ALIVE", "soon", "duration"),
    ("LOCALLLM_KV_TYPE", "q9", "KV cache type"),
    ("LOCALLLM_MAX_BODY_BYTES", "0", ">= 1"),
])
def test_bad_environment_is_a_usage_error(var: str, value: str, allowed: str, started: list[str]) -> None:
    res = invoke("serve", env={var: value})
    assert_usage_error(res, var, repr(value), allowed)
    assert started == []


def test_ps_and_run_refuse_a_bad_environment_too(started: list[str]) -> None:
    assert_usage_error(invoke("ps", env={"LOCALLLM_PORT": "99999"}), "LOCALLLM_PORT")
    # a store name makes `run` look for a server at the configured address first
    assert_usage_error(invoke("run", "gemma3:270m", "hi", env={"LOCALLLM_HOST": ":abc"}), "LOCALLLM_HOST")
    assert started == []


# ---- config.toml ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("toml", "key", "allowed"), [
    ('port = "abc"', "port", "1 to 65535"),
    ("port = 70000", "port", "1 to 65535"),
    ("port = true", "port", "1 to 65535"),
    ("slots = 0", "slots", "1 to 256"),
    ("threads = 1.5", "threads", "1 to 1024"),
    ("ctx = -1", "ctx", "1 to 1048576"),
    ("gpu_layers = -7", "gpu_layers", ">= -1"),
    ("draft_max = 99", "draft_max", "0 to 64"),
    ('lookup = "yes"', "lookup", "true or false"),
    ('allowed_hosts = "example.com"', "allowed_hosts", "list of strings"),
    ("allowed_origins = [1, 2]", "allowed_origins", "list of strings"),
    ('host = "a b"', "host", "host name or an IP address"),
    ("keep_alive = true", "keep_alive", "duration"),
    ("keep_alive = nan", "keep_alive", "duration"),
    ('keep_alive = "whenever"', "keep_alive", "duration"),
    ('kv_type = "q9"', "kv_type", "KV cache type"),
    ("prefix_cache_bytes = -1", "prefix_cache_bytes", ">= 0"),
])
def test_bad_config_value_names_file_and_key(toml: str, key: str, allowed: str, localllm_home: Path,
                                             started: list[str]) -> None:
    cfg = write_config(localllm_home, toml + "\n")
    res = invoke("serve")
    assert_usage_error(res, str(cfg), f"{key} = ", allowed)
    assert started == []


def test_a_checks_hint_is_shown(localllm_home: Path, started: list[str]) -> None:
    """A setting whose check raises a LocalLLMError with a hint: the one line says the message, then the hint."""
    from localllm.errors import InvalidInput, brief

    cfg = write_config(localllm_home, 'keep_alive = "whenever"\n')
    assert_usage_error(invoke("serve"), str(cfg), "is not a duration (use e.g. '5m', '30s', '1h', 0 or -1)")
    assert started == []
    assert brief(InvalidInput("bad", "do this")) == "bad (do this)" and brief(ValueError("v")) == "v"


def test_broken_toml_is_a_usage_error(localllm_home: Path, started: list[str]) -> None:
    cfg = write_config(localllm_home, "port = [\n")
    assert_usage_error(invoke("serve"), str(cfg), "not valid TOML")
    assert started == []


# ---- good values still work ----------------------------------------------------------------------

def test_good_values_reach_the_server(localllm_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    import localllm.server.app as app_mod

    seen: dict[str, Any] = {}
    monkeypatch.setattr(app_mod, "create_app", lambda settings, **_: seen.setdefault("settings", settings))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    write_config(localllm_home, 'keep_alive = 300\nallowed_hosts = ["example.com"]\nkv_type = "Q8_0"\n'
                 "draft_max = 0\nlookup = true\n")
    res = invoke("serve", "--port", "65535", "--host", "[::1]", "--draft-max", "64")
    assert res.exit_code == 0, res.output
    assert (seen["host"], seen["port"]) == ("::1", 65535)
    s = seen["settings"]
    assert (s.keep_alive, s.allowed_hosts, s.draft_max, s.lookup) == (300, ("example.com",), 64, True)


@pytest.mark.parametrize(("value", "host", "port"), [
    (":8099", "127.0.0.1", 8099), ("0.0.0.0:9000", "0.0.0.0", 9000), ("[::1]:8080", "::1", 8080),
    ("::1", "::1", 11434), ("http://localhost:1234/", "localhost", 1234), ("example.com", "example.com", 11434),
])
def test_localllm_host_forms(value: str, host: str, port: int) -> None:
    from localllm.config import load_settings

    s = load_settings({"LOCALLLM_HOST": value})
    assert (s.host, s.port) == (host, port)


def test_empty_optional_variables_mean_unset() -> None:
    from localllm.config import load_settings

    s = load_settings({"LOCALLLM_THREADS": "", "LOCALLLM_KV_TYPE": " ", "LOCALLLM_API_KEY": ""})
    assert (s.threads, s.kv_type, s.api_key) == (None, None, None)


def test_limits_agree_with_the_engine() -> None:
    from localllm.compose.spec import MAX_CTX
    from localllm.config import RULES
    from localllm.runtime.speculative.verify import SpecConfig

    rule = RULES["draft_max"]
    for n in (-1, 0, 1, 16, 64, 65):
        accepted = rule.lo <= n <= rule.hi  # type: ignore[operator]
        assert accepted == (not SpecConfig(draft_max=n).problems()), n
    assert RULES["ctx"].hi == MAX_CTX


# ---- as a user runs it: the real entry point, stderr only ------------------------------------------

@pytest.mark.parametrize(("args", "env", "needle"), [
    (["serve", "--port", "99999"], {}, "'--port'"),
    (["serve", "--port", "-1"], {}, "'--port'"),
    (["serve"], {"LOCALLLM_HOST": "127.0.0.1:abc"}, "LOCALLLM_HOST"),
    (["run", "missing.gguf", "hi", "--temperature", "nan"], {}, "'--temperature'"),
])
def test_entry_point_prints_one_line_and_exits_2(args: list[str], env: dict[str, str], needle: str) -> None:
    from helpers import free_port

    # a free loopback port, so that a value that slipped through could never take a real one
    full_env = os.environ | {"LOCALLLM_HOST": f"127.0.0.1:{free_port()}"} | env
    res = subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True,
                         timeout=60, env=full_env, stdin=subprocess.DEVNULL, check=False)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0], res.stderr
