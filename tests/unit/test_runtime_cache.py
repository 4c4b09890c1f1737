"""compilation_cache_dir: on by default in the user's cache folder (JAX's own
JAX_COMPILATION_CACHE_DIR wins), '' off, relative paths under the workdir, remote URLs refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpojax import runtime
from dpojax.config import default_config
from dpojax.errors import ConfigProblem


def test_the_default_is_the_users_cache_folder():
    assert default_config().compilation_cache_dir == runtime.USER_CACHE  # before: '' (off)


def test_user_means_xdg_cache_home_then_home_and_jax_own_setting_wins(tmp_path, monkeypatch):
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert runtime.user_cache_directory(env) == tmp_path / "xdg" / "dpojax" / "jax_compilation"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runtime.user_cache_directory({}) == (
        tmp_path / "home" / ".cache" / "dpojax" / "jax_compilation"
    )
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax")
    assert runtime.user_cache_directory(env) == tmp_path / "jax"


def test_paths_off_relative_absolute_and_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert runtime.cache_directory("", tmp_path / "w") is None
    assert runtime.cache_directory("jax_cache", tmp_path / "w") == tmp_path / "w" / "jax_cache"
    assert runtime.cache_directory(str(tmp_path / "abs"), "w") == tmp_path / "abs"
    assert runtime.cache_directory("~/c", "w") == tmp_path / "home" / "c"


def test_a_remote_cache_is_refused_naming_the_key():
    with pytest.raises(ConfigProblem, match="compilation_cache_dir='gs://b/c'.*local folder"):
        runtime.cache_directory("gs://b/c", Path("w"))


def test_plans_of_compile_only_devices_keep_no_cache():
    """Their compiler cannot load a cached executable: every hit warned "PjRtCompiler must be
    constructed with a Client" and compiled again. Before: only gpu: targets were exempt, and a
    tpu: plan wrote entries it could not read back."""
    from dpojax.jobs import compilation_cache_setting

    config = default_config()
    config.compilation_cache_dir = "jax_cache"
    assert compilation_cache_setting(config) == "jax_cache"  # train: the cache
    config.mode = "plan"
    for target, kept in (("local", True), ("tpu:v5e:2x2", False), ("gpu:h100:8", False)):
        config.plan.target = target
        assert compilation_cache_setting(config) == ("jax_cache" if kept else ""), target
