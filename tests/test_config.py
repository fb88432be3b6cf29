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


@pytest.mark.parametrize("name,bad", [("memory_extractor", "bogus"), ("memory_summarizer", "llm"), ("shutdown", "stop"),
                                      ("accel", "hvf"), ("log_format", "xml"), ("log_level", "loud")])
def test_a_word_setting_outside_its_choices_is_refused_not_replaced(tmp_path: Path, name: str, bad: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}='{bad}' is not one of") as e:
        load(None, env={"MOORAGE_" + name.upper(): bad})
    assert f"MOORAGE_{name.upper()}" in (e.value.hint or "")
    f = tmp_path / "moorage.toml"
    f.write_text(f'[moorage]\n{name} = "{bad}"\n')
    with pytest.raises(ConfigError, match="is not one of"):
        load(f, env={})
    assert load(None, env={"MOORAGE_LOG_LEVEL": "WARNING", "MOORAGE_MEMORY_EXTRACTOR": "model"}).log_level == "warning"
