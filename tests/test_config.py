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


@pytest.mark.parametrize("name,bad,says", [
    ("guest_calls_per_channel", "0", "at least 1"),        # every guest call answered busy: turns hung
    ("egress_connects_per_s", "0", "at least 1"),          # a division by zero on every fetch
    ("egress_max_connections", "0", "at least 1"),         # every fetch refused
    ("template_gc_interval_s", "0", "at least 1"),         # a busy loop on an idle host
    ("guest_memory_mib", "-5", "at least 128"),            # every deploy refused as "too small"
    ("max_value_bytes", "0", "at least 65536"),            # every deploy's journal over the limit
    ("app_timeout_s", "-1", "at least 1"),                 # every app request "took too long"
    ("port", "70000", "from 0 to 65535"),                  # a traceback once the server tried to bind
])
def test_a_number_a_host_could_not_work_with_is_refused_at_start(name: str, bad: str, says: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}={bad} is out of range: it must be {says}") as e:
        load(None, env={"MOORAGE_" + name.upper(): bad})
    assert f"MOORAGE_{name.upper()}" in (e.value.hint or "")


def test_types_are_exact_and_related_settings_agree(tmp_path: Path) -> None:
    f = tmp_path / "moorage.toml"
    for text, says in (("port = 7872.9", "is not a valid int"), ("egress_allow_private = \"maybe\"", "not a valid bool"),
                       ("guest_cpu_share = true", "is not a valid float"),
                       ("agent_max_memory_mib = 200", "less than guest_memory_mib=256"),
                       ("otlp_endpoint = \"not a url\"", "is not an http\\(s\\) URL"),
                       ("secrets_keys = \"k1:short\"", "8-character id and 32 key bytes")):
        f.write_text(f"[moorage]\n{text}\n")
        with pytest.raises(ConfigError, match=says):
            load(f, env={})
    f.write_text("[moorage]\nport = 7872.0\negress_allow_private = \"off\"\nagent_max_memory_mib = 512\n")
    cfg = load(f, env={"MOORAGE_PACKAGE_APT_TRUSTED": "yes"})
    assert (cfg.port, cfg.egress_allow_private, cfg.package_apt_trusted) == (7872, False, True)
    # A config file named by MOORAGE_CONFIG must exist, as one named by --config must.
    with pytest.raises(ConfigError, match="does not exist"):
        load(None, env={"MOORAGE_CONFIG": str(tmp_path / "missing.toml")})


def test_relative_paths_in_a_config_file_are_relative_to_its_directory(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    conf = tmp_path / "etc" / "moorage"
    conf.mkdir(parents=True)
    conf = conf.resolve()
    (conf / "moorage.toml").write_text('[moorage]\ndata_dir = "data"\nllm_policy = "policies/llm.toml"\n'
                                       'store_url = "sqlite:state/store"\n')
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for path in (Path("../etc/moorage/moorage.toml"), conf / "moorage.toml"):
        cfg = load(path, env={})
        assert cfg.data_dir == conf / "data"
        assert cfg.llm_policy == str(conf / "policies" / "llm.toml")
        assert cfg.store_url == f"sqlite:{conf / 'state' / 'store'}"
    via_env = load(None, env={"MOORAGE_CONFIG": "../etc/moorage/moorage.toml"})
    assert via_env.data_dir == conf / "data"
    # Absolute and home-relative paths in the file stay as written; the environment and flags keep the cwd's.
    (conf / "moorage.toml").write_text(f'[moorage]\ndata_dir = "{tmp_path / "abs"}"\nllm_policy = "~/p.toml"\n'
                                       'store_url = "sqlite"\n')
    cfg = load(conf / "moorage.toml", env={})
    assert (cfg.data_dir, cfg.llm_policy, cfg.store_url) == (tmp_path / "abs", str(Path.home() / "p.toml"), "sqlite")
    cfg = load(conf / "moorage.toml", env={"MOORAGE_DATA_DIR": "d", "MOORAGE_LLM_POLICY": "p.toml"})
    assert (cfg.data_dir, cfg.llm_policy) == (Path("d"), "p.toml")
    assert load(conf / "moorage.toml", env={}, data_dir=Path("flag")).data_dir == Path("flag")
