"""Config: defaults for every key, TOML files, TMD_* overrides, and errors that name
the offending key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tmd import config
from tmd.cli import main as cli
from tmd.errors import ConfigError


def test_defaults_need_no_file() -> None:
    c = config.load(None, env={})
    assert (c.mqtt.host, c.mqtt.port, c.api.port) == ("127.0.0.1", 1883, 9464)
    assert c.detectors == {} and c.policies == {}


def test_file_and_environment_overrides(tmp_path: Path) -> None:
    f = tmp_path / "tmd.toml"
    f.write_text(
        '[mqtt]\nhost = "broker.example"\nport = 1884\n[detectors.node_lost]\n'
        "heartbeat_timeout_s = 9\n"
    )
    c = config.load(
        f,
        env={
            "TMD_MQTT__PORT": "8883",
            "TMD_MQTT__TLS": "true",
            "TMD_API__TOKEN": "s3cret",
            "TMD_LOG__LEVEL": "debug",
            "UNRELATED": "x",
        },
    )
    assert (c.mqtt.host, c.mqtt.port, c.mqtt.tls) == ("broker.example", 8883, True)
    assert c.api.token == "s3cret" and c.log.level == "debug"
    assert c.detectors["node_lost"]["heartbeat_timeout_s"] == 9
    assert config.as_dict(c)["api"]["token"] == "***"


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"mqtt": {"port": "1883"}}, "mqtt.port"),
        ({"mqtt": {"port": 0}}, "mqtt.port"),
        ({"mqtt": {"hots": "x"}}, "mqtt.hots"),
        ({"mqtt": {"protocol": "4"}}, "mqtt.protocol"),
        ({"mqtt": {"tls": "yes"}}, "mqtt.tls"),
        ({"mqtt": {"keepalive_s": float("nan")}}, "mqtt.keepalive_s"),
        ({"mqtt": {"ca_file": "/nonexistent/ca.pem", "tls": True}}, "mqtt.ca_file"),
        ({"mqtt": {"shared_group": "a/b"}}, "mqtt.shared_group"),
        ({"mqtt": {"reconnect_min_s": 5.0, "reconnect_max_s": 1.0}}, "mqtt.reconnect_max_s"),
        ({"ingest": {"window_steps": 2}}, "ingest.window_steps"),
        ({"api": {"token": "a", "token_file": "/etc/hostname"}}, "api.token_file"),
        ({"log": {"level": "loud"}}, "log.level"),
        ({"mqttt": {}}, "mqttt"),
        ({"mqtt": 3}, "mqtt"),
        ({"detectors": {"node_lost": 1}}, "detectors.node_lost"),
    ],
)
def test_errors_name_the_key(raw: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.from_dict(raw)
    assert err.value.key == key
    assert str(err.value).startswith(f"{key}: ")


def test_bad_environment_value_names_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        config.load(None, env={"TMD_API__PORT": "http"})
    assert err.value.key == "api.port"


def test_check_config_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.toml"
    good.write_text("[api]\nport = 9999\n")
    assert cli(["check-config", str(good)]) == 0
    assert '"port": 9999' in capsys.readouterr().out

    bad = tmp_path / "bad.toml"
    bad.write_text("[api]\nport = 9999\n[detectors.node_lost]\nheartbeat_timeout = 3\n")
    assert cli(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "detectors.node_lost.heartbeat_timeout: unknown key" in err

    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[detectors.gremlin]\n")
    assert cli(["check-config", str(unknown)]) == 2
    assert "detectors.gremlin: no such plug-in" in capsys.readouterr().err

    broken = tmp_path / "broken.toml"
    broken.write_text("[api\n")
    assert cli(["check-config", str(broken)]) == 2
    assert "not valid TOML" in capsys.readouterr().err
