"""Synced directories (worker/daemon/dirsync.py): a framework's cache files written
on one host appear on the others, whole, write-once, only within their
namespace. Real etcd, coordinator and workers on loopback; each worker
stands for a host with its own directory."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path

import grpc
import pytest

from compilecast.v1 import cache_pb2 as pb
from compilecast.worker.daemon.dirsync import is_entry, key_prefix, namespace_id, split_entry
from compilecast.worker.inprocess.client import CacheClient

from .conftest import CALL_ERRORS, all_at_once, flip_middle_byte, publish, sample, status_code

KIND = "xla-autotune"
NS = {"device_kind": "NVIDIA H200", "platform_version": "cuda 13000", "jaxlib": "0.11.2"}
# The background pass never runs during a test: each pass is asked for.
QUIET = {"dir_sync_s": 3600.0, "dir_settle_s": 0.0}


def host(start_worker, coordinator, name: str, **kw) -> CacheClient:
    worker = start_worker(coordinator.cfg.listen, name, **{**QUIET, **kw})
    client = CacheClient(worker.target)
    client.worker = worker
    return client


def autotune(seed: int | bytes, size: int = 64) -> bytes:
    """An autotune result as XLA prints it (a text proto) of about `size` bytes."""
    tag = seed.hex() if isinstance(seed, bytes) else str(seed)
    lines = [f'device: "{tag}"', "run_time {", "  nanos: 1234", "}"]
    while sum(len(line) + 1 for line in lines) < size:
        lines.append(f"scratch_bytes: {len(lines)}")
    return ("\n".join(lines) + "\n").encode()


def varint(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def torch_entry(payload: bytes, size: int = 0) -> bytes:
    """A torch_xla cache file's shape: field 1 an executable (a message),
    field 2 its compile options; padded to `size` bytes when given."""
    def message(body: bytes) -> bytes:
        return b"\x0a" + varint(len(body)) + body

    options = b"\x08\x01"
    entry = message(message(payload)) + b"\x12" + varint(len(options)) + options
    if size:
        entry = message(message(payload + b"p" * (size - len(entry) - 2))) + b"\x12" + \
            varint(len(options)) + options
    return entry


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
    payload = autotune(os.urandom(8), 3000)
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
    write_whole(da.path, "entry.textproto", autotune(b"measured on an H200"))
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
    write_whole(da.path, "entry.textproto", autotune(os.urandom(8), 5000))
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
    whole = autotune(b"partial, then whole")
    target.write_bytes(whole[:10])
    (Path(d.path) / "empty").write_bytes(b"")
    (Path(d.path) / ".hidden").write_bytes(b"not an entry")
    (Path(d.path) / "x.tmp.7").write_bytes(b"not an entry")
    assert a.sync_directory(KIND, d.namespace_id).published == 0  # new: wait and see

    target.write_bytes(whole)
    old = time.time() - 60
    os.utime(target, (old, old))
    assert a.sync_directory(KIND, d.namespace_id).published == 0  # changed since the last pass
    assert a.sync_directory(KIND, d.namespace_id).published == 1  # unchanged and old: settled

    listed = list(CacheClient(coordinator.cfg.listen).list_artifacts(
        prefix=key_prefix(KIND, d.namespace_id)))
    prefix = key_prefix(KIND, d.namespace_id)
    assert [split_entry(i.artifact.key[len(prefix):])[0] for i in listed] == ["written-in-place"]
    assert listed[0].artifact.size == len(whole)


def test_concurrent_writers_of_one_entry_each_publish_and_a_third_host_takes_the_newest(
        coordinator, start_worker):
    """Entries are write-once per content: two hosts' versions of one name
    are both the fleet's, each host keeps its own file, and a host without
    the file installs the newest."""
    hosts = [host(start_worker, coordinator, n) for n in "abc"]
    dirs = [h.open_directory(KIND, NS) for h in hosts]
    versions = [autotune(b"written on a", 1200), autotune(b"written on b", 1200)]
    for d, data in zip(dirs, versions, strict=False):
        write_whole(d.path, "same-fusion.textproto", data)

    got = all_at_once([lambda h=h, d=d: h.sync_directory(KIND, d.namespace_id)
                       for h, d in zip(hosts[:2], dirs[:2], strict=True)])

    assert sum(r.published for r in got) == 2
    listed = list(CacheClient(coordinator.cfg.listen).list_artifacts(
        prefix=key_prefix(KIND, dirs[0].namespace_id)))
    newest = max(listed, key=lambda i: (i.artifact.created_unix, i.artifact.digest)).artifact
    for h, d in zip(hosts, dirs, strict=True):
        h.sync_directory(KIND, d.namespace_id)
    installed = entries(dirs[2].path)["same-fusion.textproto"]
    assert [entries(d.path)["same-fusion.textproto"] for d in dirs[:2]] == versions
    assert installed in versions and hashlib.sha256(installed).hexdigest() == newest.digest


def test_a_directory_opened_publish_off_only_installs(coordinator, start_worker):
    a, b = (host(start_worker, coordinator, n) for n in "ab")
    da = a.open_directory("torch-xla", NS)
    db = b.open_directory("torch-xla", NS, publish_off="this build cannot load its cache")
    write_whole(da.path, "1234", torch_entry(b"from a"))
    write_whole(db.path, "5678", torch_entry(b"from b"))
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
    write_whole(da.path, "entry", autotune(b"bytes"))
    a.sync_directory(KIND, da.namespace_id)

    eventually(lambda: entries(db.path) == {"entry": autotune(b"bytes")},
               "the entry installed on b")


def test_bad_directory_requests_get_clear_errors(coordinator, start_worker):
    a = host(start_worker, coordinator, "a")
    with pytest.raises(CALL_ERRORS) as bad_kind:
        a.open_directory("Not/A/Kind", NS)
    assert status_code(bad_kind.value) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(CALL_ERRORS) as unknown:
        a.sync_directory(KIND, "0" * 24)
    assert status_code(unknown.value) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(CALL_ERRORS) as too_many:
        a.open_directory(KIND, {str(i): "v" for i in range(40)})
    assert status_code(too_many.value) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(CALL_ERRORS) as on_coordinator:
        CacheClient(coordinator.cfg.listen).open_directory(KIND, NS)
    assert status_code(on_coordinator.value) == grpc.StatusCode.UNIMPLEMENTED


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
    from compilecast.worker.xla import jax_adapter

    a, b = (host(start_worker, coordinator, n) for n in "ab")
    ns = jax_adapter.autotune_namespace(jax.devices()[0].client, jax.devices()[0])
    da = a.open_directory("xla-autotune", ns)
    write_whole(da.path, "fusion-measured-on-a.textproto", autotune(b"results"))
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
    entry = torch_entry(b"x", 2048)
    assert len(entry) == 2048
    write_whole(d.path, "12345", entry)
    a.sync_directory("torch-xla", d.namespace_id)

    assert main(["status", "--worker", a.target]) == 0

    out = capsys.readouterr().out
    assert (f"directory    torch-xla {d.namespace_id}: 1 entries, 2.0 KiB; 1 published, "
            "0 installed, 0 refused (installs off: torch_xla 2.9.0: it cannot load)") in out
    assert "  namespace  release.torch_xla=2.9.0" in out and f"  path       {d.path}" in out


def test_a_torch_xla_file_cut_at_its_source_is_never_installed_elsewhere(
        coordinator, start_worker):
    """torch_xla writes in place: a file cut short by a writer that died has
    settled, but its format says it is not whole."""
    a, b = (host(start_worker, coordinator, n) for n in "ab")
    ns = {"release.torch_xla": "2.7.0"}
    da, db = a.open_directory("torch-xla", ns), b.open_directory("torch-xla", ns)
    whole = torch_entry(os.urandom(30000))
    (Path(da.path) / "1234567").write_bytes(whole[:10000])  # as if torch_xla died mid-write

    got = a.sync_directory("torch-xla", da.namespace_id)
    assert got.published == 0 and got.directory.refused == 1
    assert b.sync_directory("torch-xla", db.namespace_id).installed == 0
    assert entries(db.path) == {}
    # Rewritten whole (torch_xla on its next run): published and installed.
    (Path(da.path) / "1234567").write_bytes(whole)
    assert a.sync_directory("torch-xla", da.namespace_id).published == 1
    assert b.sync_directory("torch-xla", db.namespace_id).installed == 1
    assert entries(db.path) == {"1234567": whole}


def test_an_entry_a_host_rejects_is_revoked_and_a_good_copy_replaces_it(
        coordinator, start_worker):
    a, b, c = (host(start_worker, coordinator, n) for n in "abc")
    ns = {"release.torch_xla": "2.7.0"}
    da, db, dc = (h.open_directory("torch-xla", ns) for h in (a, b, c))
    bad, good = torch_entry(b"well formed, but torch_xla cannot load it"), \
        torch_entry(b"compiled again on b")
    write_whole(da.path, "999", bad)
    a.sync_directory("torch-xla", da.namespace_id)
    assert b.sync_directory("torch-xla", db.namespace_id).installed == 1
    # torch_xla on b fails to deserialize it: deletes it, compiles, writes its own.
    os.unlink(Path(db.path) / "999")
    got = b.sync_directory("torch-xla", db.namespace_id)
    assert got.installed == 0 and got.directory.refused == 1  # rejected, not installed again
    (Path(db.path) / "999").write_bytes(good)
    assert b.sync_directory("torch-xla", db.namespace_id).published == 1

    assert c.sync_directory("torch-xla", dc.namespace_id).installed == 1
    assert entries(dc.path) == {"999": good}
    listed = list(CacheClient(coordinator.cfg.listen).list_artifacts(
        prefix=key_prefix("torch-xla", da.namespace_id)))
    assert [i.artifact.digest for i in listed] == [hashlib.sha256(good).hexdigest()]  # purged


def test_the_symlink_swap_race_publishes_nothing_from_outside(coordinator, start_worker,
                                                             tmp_path):
    import threading

    a = host(start_worker, coordinator, "a")
    d = a.open_directory(KIND, NS)
    secret = tmp_path / "secret"
    secret.write_bytes(autotune(b"a secret outside the directory"))
    secret.chmod(0o600)
    entry = Path(d.path) / "swapped.textproto"
    mine = autotune(b"the entry's own bytes")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            tmp = Path(d.path) / ".swap.tmp"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            tmp.symlink_to(secret)
            os.replace(tmp, entry)
            tmp.write_bytes(mine)
            os.replace(tmp, entry)

    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        for _ in range(300):
            a.sync_directory(KIND, d.namespace_id)
    finally:
        stop.set()
        swapper.join()
    c = CacheClient(coordinator.cfg.listen)
    published = [c.fetch(i.artifact.key)[1] for i in c.list_artifacts(
        prefix=key_prefix(KIND, d.namespace_id))]
    assert secret.read_bytes() not in published
    assert set(published) <= {mine}


@pytest.mark.slow
def test_made_up_credentials_create_nothing_on_disk(start_coordinator, start_worker,
                                                    tokens_file):
    secured = start_coordinator(auth_tokens_file=str(tokens_file), allow_unauthenticated=False)
    worker = start_worker(secured.cfg.listen, "w", **QUIET)
    root = Path(worker.cfg.cache_dir) / "dirs"
    before = sorted(p for p in root.rglob("*")) if root.exists() else []
    refused = 0
    for i in range(10_000):
        made_up = CacheClient(worker.target, token=f"made-up-{i}")
        try:
            made_up.open_directory(KIND, {"n": str(i)})
        except CALL_ERRORS as exc:
            assert status_code(exc) == grpc.StatusCode.UNAUTHENTICATED, exc
            refused += 1
        finally:
            made_up.close()
    after = sorted(p for p in root.rglob("*")) if root.exists() else []
    assert refused == 10_000 and after == before
    # A real credential gets its directory, within the bound per tenant.
    real = CacheClient(worker.target, token="a-pub")
    assert Path(real.open_directory(KIND, NS).path).is_dir()
    from compilecast.worker.daemon.dirsync import MAX_DIRS_PER_TENANT

    for i in range(MAX_DIRS_PER_TENANT - 1):
        real.open_directory(KIND, {"n": str(i)})
    with pytest.raises(CALL_ERRORS) as over:
        real.open_directory(KIND, {"n": "one too many"})
    assert status_code(over.value) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_an_idle_directory_gives_its_place_and_a_name_holds_a_bounded_number_of_contents(
        coordinator, start_worker):
    from compilecast.worker.daemon import dirsync

    a = host(start_worker, coordinator, "a")
    sync = a.worker.dirs
    namespaces = [{"n": str(i)} for i in range(dirsync.MAX_DIRS_PER_TENANT)]
    for ns in namespaces:
        a.open_directory(KIND, ns)
    with pytest.raises(CALL_ERRORS) as err:  # every one used just now: none gives way
        a.open_directory(KIND, {"n": "one more"})
    assert status_code(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    sync.idle_s = 0.0  # (each is idle at once): the one used longest ago gives way
    first = next(iter(sync.dirs.values()))
    opened = a.open_directory(KIND, {"n": "one more"})
    assert opened.namespace_id in {d.nsid for d in sync.dirs.values()}
    assert first.nsid not in {d.nsid for d in sync.dirs.values()}
    assert len(sync.dirs) == dirsync.MAX_DIRS_PER_TENANT
    assert os.path.isdir(first.path)  # its files stay

    # One name, many contents: the fleet keeps at most MAX_VERSIONS of it.
    d = a.open_directory(KIND, NS)
    for i in range(dirsync.MAX_VERSIONS + 3):
        path = Path(d.path) / "same-name.textproto"
        path.unlink(missing_ok=True)
        write_whole(d.path, "same-name.textproto", autotune(1000 + i))
        a.sync_directory(KIND, d.namespace_id)
    names = [x.artifact.key for x in a.list_artifacts(prefix=key_prefix(KIND, d.namespace_id))]
    assert len(names) == dirsync.MAX_VERSIONS
