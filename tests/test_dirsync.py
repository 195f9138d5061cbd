"""Synced directories (worker/dirsync.py): a framework's cache files written
on one host appear on the others, whole, write-once, only within their
namespace. Real etcd, coordinator and workers on loopback; each worker
stands for a host with its own directory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.client import CacheClient
from compilecast.worker.dirsync import is_entry, key_prefix, namespace_id

from .conftest import all_at_once, flip_middle_byte, publish, sample

KIND = "xla-autotune"
NS = {"device_kind": "NVIDIA H200", "platform_version": "cuda 13000", "jaxlib": "0.11.2"}
# The background pass never runs during a test: each pass is asked for.
QUIET = {"dir_sync_s": 3600.0, "dir_settle_s": 0.0}


def host(start_worker, coordinator, name: str, **kw) -> CacheClient:
    worker = start_worker(coordinator.cfg.listen, name, **{**QUIET, **kw})
    client = CacheClient(worker.target)
    client.worker = worker
    return client


def write_whole(directory: str, name: str, data: bytes) -> None:
    """As XLA writes an autotune entry: a temporary file renamed into place."""
    tmp = Path(directory) / f"{name}.tmp.123"
    tmp.write_bytes(data)
    os.rename(tmp, Path(directory) / name)


def entries(directory: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(directory).iterdir()}


def test_an_entry_written_on_one_host_is_installed_whole_on_another(coordinator, start_worker):
    a, b = (host(start_worker, coordinator, n) for n in "ab")
    da, db = a.open_directory(KIND, NS), b.open_directory(KIND, NS)
    assert da.path != db.path and da.namespace_id == db.namespace_id == namespace_id(KIND, NS)
    payload = os.urandom(3000)
    write_whole(da.path, "aGVsbG8td29ybGQ.textproto", payload)

    assert a.sync_directory(KIND, da.namespace_id).published == 1
    got = b.sync_directory(KIND, db.namespace_id)

    assert got.installed == 1 and got.directory.entries == 1
    assert entries(db.path) == {"aGVsbG8td29ybGQ.textproto": payload}  # no temporary left
    assert sample(b.worker, "compilecast_worker_dir_entries_total", kind=KIND,
                  event="installed") == 1
    assert sample(b.worker, "compilecast_worker_dir_bytes_total", kind=KIND,
                  event="installed") == len(payload)
    status = b.status()
    [listed] = status.directories
    assert (listed.path, listed.entries, listed.bytes, listed.installed) == (
        db.path, 1, len(payload), 1)
    assert "device_kind=NVIDIA H200" in listed.namespace
    # Nothing more to do on either side.
    assert a.sync_directory(KIND, da.namespace_id).published == 0
    assert b.sync_directory(KIND, db.namespace_id).installed == 0


def test_entries_never_cross_namespaces(coordinator, start_worker):
    a, b = (host(start_worker, coordinator, n) for n in "ab")
    other = {**NS, "device_kind": "NVIDIA GB200"}
    da, db = a.open_directory(KIND, NS), b.open_directory(KIND, other)
    write_whole(da.path, "entry.textproto", b"measured on an H200")
    a.sync_directory(KIND, da.namespace_id)
    # A malformed name under B's namespace, published by hand: listed, never installed.
    direct = CacheClient(coordinator.cfg.listen)
    publish(direct, key_prefix(KIND, db.namespace_id) + ".hidden", b"x" * 10)

    got = b.sync_directory(KIND, db.namespace_id)

    assert got.installed == 0 and entries(db.path) == {}
    assert got.directory.refused == 1
    assert not is_entry(".hidden") and not is_entry("a.tmp.1") and is_entry("a.textproto")


def test_a_corrupt_entry_is_never_installed(coordinator, start_worker):
    a, b = (host(start_worker, coordinator, n) for n in "ab")
    da, db = a.open_directory(KIND, NS), b.open_directory(KIND, NS)
    write_whole(da.path, "entry.textproto", os.urandom(5000))
    a.sync_directory(KIND, da.namespace_id)
    [item] = CacheClient(coordinator.cfg.listen).list_artifacts(prefix=key_prefix(KIND, da.namespace_id))
    flip_middle_byte(coordinator.store.path_of(item.artifact.digest))

    got = b.sync_directory(KIND, db.namespace_id)

    assert got.installed == 0 and entries(db.path) == {}
    assert got.directory.refused == 1


def test_a_file_is_published_once_it_has_settled(coordinator, start_worker):
    a = host(start_worker, coordinator, "a", dir_settle_s=30.0)
    d = a.open_directory(KIND, NS)
    target = Path(d.path) / "written-in-place"  # as PyTorch/XLA writes: at its final name
    target.write_bytes(b"partial")
    (Path(d.path) / "empty").write_bytes(b"")
    (Path(d.path) / ".hidden").write_bytes(b"not an entry")
    (Path(d.path) / "x.tmp.7").write_bytes(b"not an entry")
    assert a.sync_directory(KIND, d.namespace_id).published == 0  # new: wait and see

    target.write_bytes(b"partial, then whole")
    old = time.time() - 60
    os.utime(target, (old, old))
    assert a.sync_directory(KIND, d.namespace_id).published == 0  # changed since the last pass
    assert a.sync_directory(KIND, d.namespace_id).published == 1  # unchanged and old: settled

    listed = list(CacheClient(coordinator.cfg.listen).list_artifacts(
        prefix=key_prefix(KIND, d.namespace_id)))
    assert [i.artifact.key.rpartition(".")[2] for i in listed] == ["written-in-place"]
    assert listed[0].artifact.size == len(b"partial, then whole")


def test_concurrent_writers_of_one_entry_leave_one_version(coordinator, start_worker):
    hosts = [host(start_worker, coordinator, n) for n in "abc"]
    dirs = [h.open_directory(KIND, NS) for h in hosts]
    versions = [b"written on a" * 100, b"written on b" * 100]
    for d, data in zip(dirs, versions, strict=False):
        write_whole(d.path, "same-fusion.textproto", data)

    got = all_at_once([lambda h=h, d=d: h.sync_directory(KIND, d.namespace_id)
                       for h, d in zip(hosts[:2], dirs[:2], strict=True)])

    assert sum(r.published for r in got) == 1
    winner = versions[[r.published for r in got].index(1)]
    for h, d in zip(hosts, dirs, strict=True):
        h.sync_directory(KIND, d.namespace_id)
    # Each writer keeps its own file; a third host gets the first publish's.
    assert [entries(d.path)["same-fusion.textproto"] for d in dirs] == [*versions, winner]


def test_a_directory_opened_publish_off_only_installs(coordinator, start_worker):
    a, b = (host(start_worker, coordinator, n) for n in "ab")
    da = a.open_directory("torch-xla", NS)
    db = b.open_directory("torch-xla", NS, publish_off="this build cannot load its cache")
    write_whole(da.path, "1234", b"from a")
    write_whole(db.path, "5678", b"from b")
    a.sync_directory("torch-xla", da.namespace_id)

    got = b.sync_directory("torch-xla", db.namespace_id)

    assert (got.published, got.installed) == (0, 1)
    assert got.directory.publish_off == "this build cannot load its cache"
    assert sorted(entries(db.path)) == ["1234", "5678"]


def test_the_background_pass_syncs_without_being_asked(coordinator, start_worker):
    from .conftest import eventually

    a = host(start_worker, coordinator, "a")
    b = host(start_worker, coordinator, "b", dir_sync_s=0.2)
    da, db = a.open_directory(KIND, NS), b.open_directory(KIND, NS)
    write_whole(da.path, "entry", b"bytes")
    a.sync_directory(KIND, da.namespace_id)

    eventually(lambda: entries(db.path) == {"entry": b"bytes"}, "the entry installed on b")


def test_bad_directory_requests_get_clear_errors(coordinator, start_worker):
    a = host(start_worker, coordinator, "a")
    with pytest.raises(grpc.RpcError) as bad_kind:
        a.open_directory("Not/A/Kind", NS)
    assert bad_kind.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as unknown:
        a.sync_directory(KIND, "0" * 24)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as too_many:
        a.open_directory(KIND, {str(i): "v" for i in range(40)})
    assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as on_coordinator:
        CacheClient(coordinator.cfg.listen).open_directory(KIND, NS)
    assert on_coordinator.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_prefix_lists_only_its_keys(coordinator):
    c = CacheClient(coordinator.cfg.listen)
    for key in ("a.1", "b.1", "b.2", "c.1"):
        publish(c, key, key.encode())
    assert [i.artifact.key for i in c.list_artifacts(prefix="b.")] == ["b.1", "b.2"]
    assert [i.artifact.key for i in c.list_artifacts(prefix="b.", page=1)] == ["b.1", "b.2"]
    resp = c.stub.ListArtifacts(pb.ListArtifactsRequest(prefix="b.", after="a.9"))
    assert [i.artifact.key for i in resp.artifacts] == ["b.1", "b.2"]


def test_a_gpu_compile_reads_and_writes_the_hosts_synced_autotune_directory(
        coordinator, start_worker, monkeypatch):
    """This CPU stands in for a GPU: a process on host b compiles with XLA's
    autotune directory set to b's synced directory, which already holds the
    entry host a published."""
    import jax
    import jax.numpy as jnp
    from jax._src import compiler

    import compilecast.jax
    from compilecast.worker import jax_adapter

    a, b = (host(start_worker, coordinator, n) for n in "ab")
    ns = jax_adapter.autotune_namespace(jax.devices()[0].client, jax.devices()[0])
    da = a.open_directory("xla-autotune", ns)
    write_whole(da.path, "fusion-measured-on-a.textproto", b"results")
    a.sync_directory("xla-autotune", da.namespace_id)
    monkeypatch.setattr(jax_adapter, "GPU_PLATFORMS", frozenset({"cpu"}))
    seen = []
    compile_and_load = compiler.backend_compile_and_load

    def recording(backend, module, devices, options, host_callbacks):
        directory = options.executable_build_options.debug_options.\
            xla_gpu_per_fusion_autotune_cache_dir
        seen.append((directory, tuple(sorted(os.listdir(directory))) if directory else None))
        return compile_and_load(backend, module, devices, options, host_callbacks)

    monkeypatch.setattr(compiler, "backend_compile_and_load", recording)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    assert compilecast.jax.enable(b.target) is not None
    try:
        jax.jit(lambda x: x * 5 - 2)(jnp.arange(11.0)).block_until_ready()
    finally:
        compilecast.jax.disable()

    [db] = b.status().directories
    assert seen and set(seen) == {(db.path, ("fusion-measured-on-a.textproto",))}
    assert db.namespace_id == da.namespace_id and db.path != da.path


def test_status_shows_each_directory_its_namespace_and_size(coordinator, start_worker, capsys):
    from compilecast.cli import main

    a = host(start_worker, coordinator, "a")
    d = a.open_directory("torch-xla", {"release.torch_xla": "2.9.0"},
                         install_off="torch_xla 2.9.0: it cannot load")
    write_whole(d.path, "12345", b"x" * 2048)
    a.sync_directory("torch-xla", d.namespace_id)

    assert main(["status", "--worker", a.target]) == 0

    out = capsys.readouterr().out
    assert (f"directory    torch-xla {d.namespace_id}: 1 entries, 2.0 KiB; 1 published, "
            "0 installed, 0 refused (installs off: torch_xla 2.9.0: it cannot load)") in out
    assert "  namespace  release.torch_xla=2.9.0" in out and f"  path       {d.path}" in out
