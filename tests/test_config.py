from pathlib import Path

import pytest

from moorage.config import load
from moorage.errors import ConfigError


def test_defaults_file_env_precedence(tmp_path: Path) -> None:
    f = tmp_path / "moorage.toml"
    f.write_text('[moorage]\nport = 9000\nstore_url = "sqlite"\n[agent]\nname = "x"\n')
    cfg = load(f, env={"MOORAGE_PORT": "9100", "MOORAGE_DATA_DIR": str(tmp_path / "d")})
    assert cfg.port == 9100
    assert cfg.data_dir == tmp_path / "d"
    assert cfg.store_url == "sqlite"


def test_unknown_setting_is_a_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "moorage.toml"
    f.write_text("[moorage]\nprot = 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'prot'"):
        load(f, env={})


def test_bad_value_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="MOORAGE_PORT"):
        load(Path("/nonexistent-dir/none.toml") if False else None, env={"MOORAGE_PORT": "abc"})


def test_fleet_template_prefetch_settings_from_the_file(tmp_path: Path) -> None:
    f = tmp_path / "moorage.toml"
    f.write_text("[moorage]\ntemplate_prefetch = 3\ntemplate_prefetch_interval_s = 15\n")
    cfg = load(f, env={})
    assert (cfg.template_prefetch, cfg.template_prefetch_interval_s) == (3, 15.0)
    assert load(None, env={}).template_prefetch == 8  # on by default (it acts only in a fleet)
    f.write_text("[moorage]\ntemplate_prefetch_interval_s = 0\n")
    with pytest.raises(ConfigError, match="template_prefetch_interval_s must be more than 0"):
        load(f, env={})
