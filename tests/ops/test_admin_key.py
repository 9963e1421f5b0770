"""The admin key of a first start: made once when the config names none, kept in a file of
mode 0600 beside the store, read again on every later start, never made when admin_keys are
configured, and never in a log line (the start-up line names the file)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from proxy.config import Config, ConfigError, parse_config
from proxy.ops.admin_key import key_file, provide_admin_key


def config_in(tmp_path: Path, **data: object) -> Config:
    return parse_config(
        {"store": "sqlite:///./data/recap.db", **data}, env={}, base_dir=str(tmp_path)
    )


def test_a_first_start_makes_a_key_beside_the_database_and_reuses_it(tmp_path: Path) -> None:
    config = config_in(tmp_path)
    assert config.admin_keys == ()
    served, page = provide_admin_key(config)
    path = tmp_path / "data" / "recap.db-admin-key"
    assert page.source == "file" and page.path == path and page.made
    (key,) = served.admin_keys
    assert path.read_text().strip() == key and len(key) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # Everything else is the config as it was.
    assert served.tenants == config.tenants and served.store == config.store

    again, page = provide_admin_key(config)  # a restart
    assert again.admin_keys == (key,) and not page.made


def test_configured_admin_keys_make_nothing(tmp_path: Path) -> None:
    config = config_in(tmp_path, admin_keys=["configured-admin-key"])
    served, page = provide_admin_key(config)
    assert served is config and page.source == "config" and page.path is None
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    ("store", "name"),
    [("sqlite:///:memory:", "recap-admin-key"), ("postgresql://db/recap", "recap-admin-key")],
)
def test_without_a_database_file_the_key_is_beside_the_config(
    tmp_path: Path, store: str, name: str
) -> None:
    config = parse_config({"store": store}, env={}, base_dir=str(tmp_path))
    assert key_file(config) == tmp_path / name


def test_a_key_file_that_cannot_be_written_leaves_the_page_without_a_key(tmp_path: Path) -> None:
    # A file where the database's directory should be: nothing can be written there (a
    # read-only directory would do, but not for root, who runs the tests in containers).
    (tmp_path / "data").write_text("")
    served, page = provide_admin_key(config_in(tmp_path))
    assert served.admin_keys == () and page.source == "none"
    assert page.problem is not None and page.problem.startswith("cannot write ")


def test_an_empty_or_shared_key_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "data" / "recap.db-admin-key"
    path.parent.mkdir()
    path.write_text("\n")
    served, page = provide_admin_key(config_in(tmp_path))
    assert served.admin_keys == () and page.problem is not None and "empty" in page.problem
    # A tenant's proxy key pasted there would open every tenant to that tenant's clients.
    path.write_text("tenant-key-0123\n")
    with pytest.raises(ConfigError, match="a tenant's proxy key"):
        provide_admin_key(config_in(tmp_path, tenants={"t": {"api_keys": ["tenant-key-0123"]}}))


def test_a_key_file_readable_by_others_is_used_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "data" / "recap.db-admin-key"
    path.parent.mkdir()
    path.write_text("an-operators-own-key\n")
    path.chmod(0o644)
    served, page = provide_admin_key(config_in(tmp_path))
    assert served.admin_keys == ("an-operators-own-key",)
    assert page.warning is not None and "chmod 600" in page.warning
