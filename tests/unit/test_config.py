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
        # Several heads sharing a group may watch, not act: acks would be split.
        ({"mqtt": {"shared_group": "heads"}}, "mqtt.shared_group"),
        ({"mqtt": {"reconnect_min_s": 5.0, "reconnect_max_s": 1.0}}, "mqtt.reconnect_max_s"),
        ({"ingest": {"window_steps": 2}}, "ingest.window_steps"),
        ({"ingest": {"shards": 65}}, "ingest.shards"),
        ({"ingest": {"shards": -1}}, "ingest.shards"),
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


def test_no_secret_is_ever_echoed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """check-config masks every secret key; an error about a secret names the key and
    never the value."""
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    values = {("mqtt", "password"): "hunter2-mqtt", ("api", "token"): "hunter2-api"}
    assert set(values) == set(config.SECRETS)
    good = tmp_path / "good.toml"
    good.write_text("".join(f'[{s}]\n{k} = "{v}"\n' for (s, k), v in values.items()))
    assert cli(["check-config", str(good)]) == 0
    out = capsys.readouterr().out
    assert out.count('"***"') == len(values)
    assert not [v for v in values.values() if v in out]
    for section, key in config.SECRETS:
        bad = tmp_path / f"bad-{key}.toml"
        bad.write_text(f"[{section}]\n{key} = 31337\n")
        assert cli(["check-config", str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"{section}.{key}" in err and "31337" not in err


def test_secrets_default_to_systemd_credentials(tmp_path: Path) -> None:
    """Under systemd (LoadCredential=), an unset secret file key reads the credential
    of its name; one set in the file wins, and a key without its certificate is not
    picked up alone."""
    creds = tmp_path / "creds"
    creds.mkdir()
    for name in ("mqtt-password", "api-token", "mqtt-key"):
        (creds / name).write_text("secret\n")
    c = config.load(None, env={"CREDENTIALS_DIRECTORY": str(creds)})
    assert c.mqtt.password_file == str(creds / "mqtt-password")
    assert c.mqtt.read_password() == "secret"
    assert c.api.token_file == str(creds / "api-token")
    assert (c.mqtt.cert_file, c.mqtt.key_file) == ("", "")  # no mqtt-cert: no client cert
    own = tmp_path / "tmd.toml"
    own.write_text('[mqtt]\npassword = "inline"\n')
    c = config.load(own, env={"CREDENTIALS_DIRECTORY": str(creds)})
    assert (c.mqtt.password, c.mqtt.password_file) == ("inline", "")
    assert config.load(None, env={}).mqtt.password_file == ""
