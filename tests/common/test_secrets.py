"""Credentials in URIs: redacted in everything a config is written as, restored from the environment on resume."""

from __future__ import annotations

import pytest

from common.config import ConfigError, flatten, load_config, restore_secrets, resume_config, to_yaml
from common.config.secrets import hidden, redact, redact_value, split_password, with_password


@pytest.mark.parametrize("text, expected", [
    ("http://alice:PASSWORD@127.0.0.1:9/", "http://alice:***@127.0.0.1:9/"),
    ("https://alice@host/", "https://alice@host/"),  # a user alone is no secret
    ("https://host:5000/api", "https://host:5000/api"),
    ("sqlite:////tmp/runs/mlflow.db", "sqlite:////tmp/runs/mlflow.db"),
    ("mysql://u:p%40ss@h/db", "mysql://u:***@h/db"),  # percent-encoded
    ("postgresql+psycopg2://user:p@ss@db.host:5432/mlflow", "postgresql+psycopg2://user:***@db.host:5432/mlflow"),
    ("postgresql://user:pa:ss@h", "postgresql://user:***@h"),  # a ':' in the password, no path
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),  # no user
    ("https://h/x?token=abc&page=2", "https://h/x?token=***&page=2"),
    ("postgresql://h/db?sslmode=require&password=pw", "postgresql://h/db?sslmode=require&password=***"),
    ("s3://b/k?X-Amz-Credential=AK&X-Amz-Signature=abc", "s3://b/k?X-Amz-Credential=***&X-Amz-Signature=***"),
    ("https://acct.blob.core.windows.net/c?sv=2020&sig=abc%3D", "https://acct.blob.core.windows.net/c?sv=2020&sig=***"),
    ("could not reach http://a:b@h:1/api/2.0 (refused); retry http://a:b@h:1/x",
     "could not reach http://a:***@h:1/api/2.0 (refused); retry http://a:***@h:1/x"),  # in a message
    ("http://a:***@h/", "http://a:***@h/"),  # redacting twice changes nothing
])
def test_redact(text, expected):
    assert redact(text) == expected


def test_a_value_is_redacted_only_when_it_is_one_uri():
    assert redact_value("http://a:b@h/") == "http://a:***@h/"
    prompt = "Answer like http://a:b@h/ would."  # a prompt quoting one is the user's text, kept as written
    assert redact_value(prompt) == prompt and redact_value(8) == 8 and redact_value(None) is None
    assert hidden("http://a:***@h/") and hidden("https://h/?token=***")
    assert not hidden("http://a:b@h/") and not hidden("http://a@h/") and not hidden(None)


def test_split_and_fill_the_password():
    assert split_password("https://alice:p%40ss@h:5/x") == ("https://h:5/x", "alice", "p@ss")
    assert split_password("https://alice@h/") == ("https://alice@h/", None, None)
    assert with_password("postgresql://u:***@h/db", "p@ss/w") == "postgresql://u:p%40ss%2Fw@h/db"


URI = "http://alice:PASSWORD@127.0.0.1:9/"


def test_config_yaml_and_mlflow_params_hold_no_password_while_the_config_does():
    cfg = load_config(None, [f"tracking.uri={URI}", "cluster.address=ray://bob:secret@head:10001"])
    assert cfg.tracking.uri == URI  # the run itself reaches its store with it
    written = to_yaml(cfg) + repr(flatten(cfg))
    assert "PASSWORD" not in written and "secret" not in written
    assert flatten(cfg)["tracking.uri"] == "http://alice:***@127.0.0.1:9/"
    assert "ray://bob:***@head:10001" in to_yaml(cfg)


def test_resume_takes_the_password_from_the_environment_or_from_the_uri_given_again(monkeypatch, tmp_path):
    saved_path = tmp_path / "config.yaml"
    saved_path.write_text(to_yaml(load_config(None, [f"tracking.uri={URI}"])))
    from common.config import load_saved_config

    saved = load_saved_config(saved_path)[0]
    assert saved.tracking.uri == "http://alice:***@127.0.0.1:9/"
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    with pytest.raises(ConfigError) as e:
        resume_config(saved, [])
    assert e.value.lines == ["tracking.uri: http://alice:***@127.0.0.1:9/: its secret was redacted (*** is all the run "
                             "folder keeps); set MLFLOW_TRACKING_PASSWORD=<the password>, or pass "
                             "tracking.uri=<the URI with it>"]
    new, changes = resume_config(saved, [f"tracking.uri={URI}"])  # the same store with its password: no change
    assert new.tracking.uri == URI and changes == {}
    with pytest.raises(ConfigError, match="tracking.uri cannot change on resume"):
        resume_config(saved, ["tracking.uri=http://alice:PASSWORD@elsewhere:9/"])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "p@ss")
    assert resume_config(saved, [])[0].tracking.uri == "http://alice:p%40ss@127.0.0.1:9/"


def test_a_redacted_secret_the_environment_cannot_give_names_its_field():
    cfg = load_config(None, ["tracking.uri=https://h/?token=***", "cluster.address=ray://bob:***@head:10001"])
    with pytest.raises(ConfigError) as e:
        restore_secrets(cfg)
    assert [line.split(":")[0] for line in e.value.lines] == ["cluster.address", "tracking.uri"]
    assert all("pass " in line and "MLFLOW_TRACKING_PASSWORD" not in line for line in e.value.lines)
