"""The one adapter over JAX's private code: fails loudly when JAX moves it."""

from __future__ import annotations

import jax
import pytest

from compilecast.worker import jax_adapter


def test_this_jax_release_exposes_everything_the_adapter_hooks():
    # If this fails, a JAX upgrade moved a private API: fix jax_adapter.py,
    # do not skip this test.
    jax_adapter.check()
    assert jax_adapter.check_optional() == []  # Mosaic's dialect, for Pallas kernels' keys


def test_a_missing_mosaic_dialect_is_named_but_does_not_stop_the_hooks(monkeypatch):
    from jax._src import lib

    monkeypatch.delattr(lib, "tpu")
    monkeypatch.setitem(__import__("sys").modules, "jax._src.lib.tpu", None)
    assert "jax._src.lib.tpu" in jax_adapter.check_optional()[0]
    jax_adapter.check()  # install() still goes ahead


def test_adapter_names_what_moved(monkeypatch):
    from jax._src import compiler

    monkeypatch.delattr(compiler, "_compile_and_write_cache")
    with pytest.raises(jax_adapter.AdapterError, match="_compile_and_write_cache is gone"):
        jax_adapter.check()


def test_adapter_detects_a_changed_signature(monkeypatch):
    from jax._src import compiler

    monkeypatch.setattr(compiler, "_cache_read", lambda module_name, cache_key: None)
    with pytest.raises(jax_adapter.AdapterError, match="_cache_read"):
        jax_adapter.check()


def test_enable_with_a_moved_api_warns_and_leaves_jax_alone(monkeypatch, caplog):
    from jax._src import compilation_cache, compiler

    import compilecast.jax

    monkeypatch.delattr(compiler, "_cache_read")
    assert compilecast.jax.enable("unix:///nonexistent") is None
    assert "compilecast disabled" in caplog.text
    assert compilation_cache._cache is None


@pytest.mark.parametrize("env", [{"COMPILECAST_KEY_IGNORE_HLO_FIELDS": "instruction.nope"},
                                 {"COMPILECAST_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS": "soon"}])
def test_enable_with_bad_configuration_warns_and_leaves_jax_alone(monkeypatch, caplog, env):
    from jax._src import compilation_cache

    import compilecast.jax

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert compilecast.jax.enable("unix:///nonexistent") is None
    assert "compilecast disabled" in caplog.text
    assert compilation_cache._cache is None


def test_install_and_uninstall_restore_jax(tmp_path):
    from jax._src import compilation_cache, compiler

    import compilecast.jax

    original = compiler._cache_read
    cache = compilecast.jax.enable(f"unix://{tmp_path}/none.sock")
    try:
        assert cache is not None
        assert compilation_cache._cache is cache
        assert compiler._cache_read is not original
        assert jax.config.jax_share_binary_between_hosts is False
    finally:
        compilecast.jax.disable()
    assert compiler._cache_read is original
    assert compilation_cache._cache is None
