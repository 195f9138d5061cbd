"""The one adapter over JAX's private code: fails loudly when JAX moves it."""

from __future__ import annotations

import jax
import pytest

from compilecast.worker.xla import jax_adapter


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


class _Backend:
    def __init__(self, platform: str, platform_version: str = "") -> None:
        self.platform = platform
        self.platform_version = platform_version


def _options():
    from jax._src import compiler

    return compiler.get_compile_options(num_replicas=1, num_partitions=1)


def test_a_gpu_job_of_several_processes_compiles_without_sharded_autotuning(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    opts = _options()
    alone = jax_adapter.compile_alone(_Backend("cuda"), opts)
    assert (jax_adapter.SHARD_AUTOTUNING, False) in alone.env_option_overrides
    assert opts.env_option_overrides == []  # JAX's own options are left as they were
    assert jax_adapter.compile_alone(_Backend("cuda"), alone) is alone  # once
    # Left alone: other platforms, one process, a setting the user made.
    assert jax_adapter.compile_alone(_Backend("cpu"), opts) is opts
    asked = _options()
    asked.env_option_overrides = [(jax_adapter.SHARD_AUTOTUNING, True)]
    assert jax_adapter.compile_alone(_Backend("rocm"), asked) is asked
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert jax_adapter.compile_alone(_Backend("cuda"), opts) is opts


def test_this_xla_knows_the_sharded_autotuning_option():
    """XLA refuses an override it does not know (or of the wrong type): if it
    renames the option, this fails here rather than every GPU compile."""
    import jax.numpy as jnp
    from jax._src import compiler
    from jax._src.lib import xla_client

    opts = _options()
    opts.env_option_overrides = [(jax_adapter.SHARD_AUTOTUNING, False)]
    module = jax.jit(lambda x: x @ x).lower(jnp.ones((4, 4))).compiler_ir("stablehlo")
    executable = compiler.backend_compile_and_load(
        jax.devices()[0].client, module, xla_client.DeviceList(tuple(jax.devices()[:1])), opts, [])
    assert executable is not None
    opts.env_option_overrides = [("xla_gpu_no_such_option", False)]
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        compiler.backend_compile_and_load(
            jax.devices()[0].client, module, xla_client.DeviceList(tuple(jax.devices()[:1])),
            opts, [])


def test_the_hooked_compile_gets_the_options_without_sharded_autotuning(monkeypatch, tmp_path):
    """The wiring: what compilecast's compile hook hands XLA (this CPU standing
    in for a GPU of a 2-process job; no worker: the compile falls back)."""
    import jax.numpy as jnp
    from jax._src import compiler

    import compilecast.jax

    monkeypatch.setattr(jax_adapter, "GPU_PLATFORMS", frozenset({"cpu"}))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    seen = []
    compile_and_load = compiler.backend_compile_and_load

    def recording(backend, module, devices, options, host_callbacks):
        seen.append(list(options.env_option_overrides))
        return compile_and_load(backend, module, devices, options, host_callbacks)

    monkeypatch.setattr(compiler, "backend_compile_and_load", recording)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    assert compilecast.jax.enable(f"unix://{tmp_path}/none.sock") is not None
    try:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
    finally:
        compilecast.jax.disable()
    assert seen and all((jax_adapter.SHARD_AUTOTUNING, False) in s for s in seen), seen


def test_a_gpu_compile_gets_the_hosts_autotune_directory_unless_jax_gave_one():
    opts = _options()
    mine = jax_adapter.with_autotune_dir(opts, "/hostcache/dirs/host/xla-autotune/ns")
    debug = mine.executable_build_options.debug_options
    assert debug.xla_gpu_per_fusion_autotune_cache_dir == "/hostcache/dirs/host/xla-autotune/ns"
    assert debug.xla_gpu_experimental_autotune_cache_mode == \
        jax_adapter._xc.AutotuneCacheMode.UPDATE
    assert opts.executable_build_options.debug_options.xla_gpu_per_fusion_autotune_cache_dir == ""
    # JAX's own (the user's compilation cache directory) stays; no directory: nothing changes.
    assert jax_adapter.with_autotune_dir(mine, "/elsewhere") is mine
    assert jax_adapter.with_autotune_dir(opts, "") is opts
    # Where the results live never changes a key.
    assert jax_adapter.compile_options_bytes(mine) != b""
    debug.xla_gpu_experimental_autotune_cache_mode = \
        opts.executable_build_options.debug_options.xla_gpu_experimental_autotune_cache_mode
    assert jax_adapter.compile_options_bytes(mine) == jax_adapter.compile_options_bytes(opts)


def test_the_autotune_namespace_names_the_gpu_and_the_software(monkeypatch):
    class Device:
        device_kind = "NVIDIA H200"
        compute_capability = "9.0"

    ns = jax_adapter.autotune_namespace(_Backend("cuda", "cuda 13000"), Device())
    assert ns["device_kind"] == "NVIDIA H200" and ns["compute_capability"] == "9.0"
    assert ns["platform_version"] == "cuda 13000"
    assert ns["jaxlib"] == jax_adapter.jaxlib_version()
    assert jax_adapter.autotune_namespace(_Backend("cuda", "cuda 12080"), Device()) != ns
