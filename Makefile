# compilecast: `make demo` and `make test` work on a fresh Debian/Ubuntu machine.
# Everything Python goes into the project's virtualenv, .venv (made with uv where
# it is installed, else with the venv module): the system Python is left as it was.
SYSPY   ?= python3
VENV    := .venv
PY      ?= $(VENV)/bin/python
UV      := $(shell command -v uv 2>/dev/null)
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
HELM_VERSION ?= v3.22.0
GOBIN   ?= $(CURDIR)/bin
HELM    := $(GOBIN)/helm
WEED_VERSION ?= v0.0.0-20261109003541-7506e5f91cd6
WEED    := $(GOBIN)/weed
STAMP   := .make-installed
# PyTorch/XLA releases the tests run (CPU), each in a virtualenv of its own:
# torch and torch-xla from PyPI, 2.3 GB a release. PyPI's torch for Linux links
# CUDA's libraries, which its loader opens even on a CPU: one copy (4.3 GB, the
# newest release's) serves every release (scripts/torch_xla_venv.py). Triton
# (torch's GPU kernel compiler) is left out; no pip cache is kept.
TORCH_XLA := .venv/torch-xla
TORCH_XLA_RELEASES := 2.7 2.9
TORCH_CUDA := .venv/torch-cuda-libs

.PHONY: install package tools prometheus demo test test-matrix test-fast lint typecheck resolve proto bench bench-smoke clean

$(VENV)/bin/python:
ifdef UV
	$(UV) venv --seed --python $(SYSPY) $(VENV)
else
	$(SYSPY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
endif

$(STAMP): pyproject.toml $(wildcard worker/*/*.c) | $(VENV)/bin/python
	@command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || \
	  ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq etcd-server etcd-client)
	@command -v cc >/dev/null 2>&1 || \
	  ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq gcc libc6-dev)
ifdef UV
	$(UV) pip install -q --python $(PY) -e '.[test]'
else
	$(PY) -m pip install -q -e '.[test]'
endif
	@touch $(STAMP)

# Helm is not a Debian package: build the pinned release from the Go module proxy.
$(HELM):
	bash scripts/go_build.sh helm.sh/helm/v3@$(HELM_VERSION) ./cmd/helm $(HELM)

# SeaweedFS, the object store the tests run (`weed server -s3`), built from its
# downloaded source (about 5 minutes).
$(WEED):
	bash scripts/go_build.sh github.com/seaweedfs/seaweedfs@$(WEED_VERSION) ./weed $(WEED)

$(TORCH_CUDA)/.installed:
	rm -rf $(TORCH_CUDA)
	$(SYSPY) scripts/torch_xla_venv.py cuda $(TORCH_CUDA) $(lastword $(TORCH_XLA_RELEASES))

$(TORCH_XLA)-%/.installed: | $(TORCH_CUDA)/.installed
	rm -rf $(TORCH_XLA)-$*
	$(SYSPY) scripts/torch_xla_venv.py venv $(TORCH_XLA)-$* $* $(TORCH_CUDA)
	touch $@

tools: $(HELM) $(WEED)

# The package (with etcd and a C compiler), all the demo needs. The stamp stands
# for "installed from this checkout": an editable install that points elsewhere
# (a moved or copied checkout) installs again.
package: | $(VENV)/bin/python
	@$(PY) -c "import os, sys, compilecast.worker as w; \
	  sys.exit(not os.path.realpath(w.__file__).startswith(os.path.realpath('worker') + os.sep))" \
	  2>/dev/null || rm -f $(STAMP)
	@$(MAKE) --no-print-directory $(STAMP)

# Prometheus from Debian: tests/test_dashboard.py scrapes a run with it.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ] || \
	  ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq prometheus)

# Everything the tests and benchmarks need.
install: package tools prometheus $(TORCH_XLA_RELEASES:%=$(TORCH_XLA)-%/.installed)

demo: package
	$(PY) -m compilecast.demo

# mypy reads every product module under its import name, from a tree of
# links laid out as the package installs (scripts/typecheck_tree.py).
typecheck: package
	$(PY) scripts/typecheck_tree.py build/typecheck
	$(PY) -m mypy

# Pyright (editors' language servers) resolves compilecast.worker.* and
# compilecast.coordinator.* from a checkout through the same tree of links
# (pyrightconfig.json) and checks the types of the product, bench/ and
# scripts/ in its basic mode; scripts/resolve_check.py fails on any error of
# those, and on any import of ours it cannot resolve there and in tests/.
PYRIGHT_VERSION := 1.1.414
PYRIGHT := build/pyright/node_modules/.bin/pyright
$(PYRIGHT):
	mkdir -p build/pyright
	cd build/pyright && npm install --no-audit --no-fund --silent pyright@$(PYRIGHT_VERSION)

resolve: typecheck $(PYRIGHT)
	$(PY) scripts/resolve_check.py $(PYRIGHT)

test: install
	$(PY) -m ruff check .
	$(MAKE) typecheck
	$(MAKE) resolve
	$(HELM) lint --strict helm/compilecast
	HELM=$(HELM) $(PY) -m pytest

# The version matrix's other rows (noxfile.py): the JAX-facing suites on Python
# 3.12 and 3.13 with the newest JAX, each in a virtualenv under .nox/.
test-matrix: package
	$(PY) -m nox

test-fast: install
	$(PY) -m pytest -m "not slow"

lint: install
	$(PY) -m ruff check .
	$(MAKE) typecheck

# The messages and the service, with typed stubs of both (mypy-protobuf).
proto:
	$(PY) -m grpc_tools.protoc -I protos --python_out=protos --grpc_python_out=protos \
	  --plugin=protoc-gen-mypy=$(VENV)/bin/protoc-gen-mypy --mypy_out=protos \
	  --plugin=protoc-gen-mypy_grpc=$(VENV)/bin/protoc-gen-mypy_grpc --mypy_grpc_out=protos \
	  protos/compilecast/v1/cache.proto

bench: install
	$(PY) bench/keys.py
	$(PY) bench/keys.py --nested --sizes-mb 0.1 1
	$(PY) bench/keys.py --side-by-side-layers 29 240 2400 14400
	$(PY) bench/time_to_executable.py
	$(PY) bench/time_to_executable.py --tpu v5e:4x4
	$(PY) bench/time_to_executable.py --tpu v5e:4x4 --n 32 64 --tpu-baseline-max 0 --tpu-pairs 2
	$(PY) bench/time_to_executable.py --tpu v5e:4x4 --tpu-weights --tpu-after
	$(PY) bench/time_to_executable.py --tpu v5e:4x4 --tpu-weights --n 4 --tpu-pairs 3
	$(PY) bench/time_to_executable.py --tpu v5e:4x4 --tpu-weights --n 4 --tpu-pairs 2 --tpu-one-host
	$(PY) bench/publish_overlap.py --upload-mbps 0 50
	$(PY) bench/warm_start.py
	$(PY) bench/small_compiles.py --pairs 3
	$(PY) bench/job_shapes.py --n 3 --rounds 3
	$(PY) bench/waiters.py --n 63 --rounds 2
	$(PY) bench/time_to_executable.py --tpu v5e:4x4 --n 16 --tpu-baseline-max 0 --tpu-pairs 2 --tpu-host-workers
	$(PY) bench/fetch.py
	$(PY) bench/bucket_fetch.py --mb 256 --pairs 3
	$(PY) bench/bucket_stall.py --seconds 10
	$(PY) bench/publish.py
	$(PY) bench/publish.py --through-worker
	$(PY) bench/time_to_executable.py --tpu v5e:4x4 --tpu-weights --n 4 --tpu-pairs 2 --tpu-host-workers
	$(PY) bench/fetch.py --sizes-mb 100 1024 --compressible
	$(PY) bench/cold_fetch.py --mb 1024 --pairs 4
	$(PY) bench/cold_fetch.py --mb 256 --pairs 3 --processes 8
	$(PY) bench/decisions.py
	$(PY) bench/decisions.py --batch 100 --clients 100
	$(PY) bench/decisions.py --streams 8
	$(PY) bench/decisions.py --streams 8 --hit-ratio 1.0 --rate 2000
	$(PY) bench/decisions.py --streams 8 --hit-ratio 1.0 --rate 5000 --pin
	$(PY) bench/decisions.py --streams 8 --pod
	$(PY) bench/decisions.py --loadgen go --streams 8 --rate 5000 --hit-ratio 0.9 --pin --repeat 3
	$(PY) bench/decisions.py --loadgen go --streams 8 --rate 5000 --hit-ratio 0.9 --pin --repeat 3 --busy-gap-ms 0
	$(PY) bench/decisions.py --loadgen go --streams 8 --rate 5000 --hit-ratio 0.9 --pin --repeat 3 --components 11
	$(PY) bench/decisions.py --loadgen go --streams 8 --rate 5000 --hit-ratio 0.9 --pin --repeat 3 --components 11 --components-hits-every 8
	$(PY) bench/miss_storm.py
	$(PY) bench/records.py
	$(PY) bench/lease_takes.py
	$(PY) bench/pod_start.py
	$(PY) bench/pod_start.py --wait-calls
	$(PY) bench/pod_start.py --per-host 8
	$(PY) bench/pod_start.py --components 11
	$(PY) bench/pod_start.py --components 11 --components-from all
	$(PY) bench/pod_cold.py --hosts 1200 10000 --per-key-hosts 5000 10000 --per-key-programs 5 --programs 100 --compile-ms 50
	$(PY) bench/fanout.py
	$(PY) bench/fanout.py --compressible
	@# Hosts of their own (network namespaces, tc, CPU quotas) need root.
	@if [ "$$(id -u)" = 0 ]; then \
	  $(PY) bench/fanout.py --mb 64 --link-mbps 50 --fanouts 1 2 && \
	  $(PY) bench/fanout.py --mb 64 --link-mbps 50 --fanouts 2 --workers 24 && \
	  $(PY) bench/fanout.py --mb 128 --host-cpus 0.11 --fanouts 2 1 && \
	  $(PY) bench/time_to_executable.py --tpu v5e:4x4 --tpu-weights --n 8 --host-cpus 0.2 --tpu-pairs 3 --tpu-baseline-max 0; \
	else echo "bench/fanout.py --link-mbps/--host-cpus, time_to_executable.py --host-cpus: skipped (needs root)"; fi
	$(PY) bench/aot_farm.py --layers 64
	$(PY) bench/pjrt_wave.py --n 64
	$(PY) bench/pjrt_gate_flood.py --idle 10000 --slow 50 --huge 4
	$(PY) bench/sweep.py --records
	$(PY) bench/listing.py --artifacts 10000
	$(PY) bench/tracing_exit.py --repeat 3

# Every CPU bench end to end at toy sizes (~4 minutes): a bench that no longer
# runs shows here. The figures it prints mean nothing; `make bench` measures.
bench-smoke: install
	$(PY) bench/keys.py --sizes-mb 0.1 --repeat 1
	$(PY) bench/warm_start.py --layers 8 --width 64 --repeat 1
	$(PY) bench/time_to_executable.py --n 2 --layers 4 --width 64 --distributed 2
	$(PY) bench/fetch.py --sizes-mb 8
	$(PY) bench/bucket_fetch.py --mb 8 --pairs 1
	$(PY) bench/bucket_stall.py --seconds 2 --published 2
	$(PY) bench/publish.py --sizes-mb 8 --pairs 1
	$(PY) bench/publish.py --sizes-mb 8 --pairs 1 --through-worker
	$(PY) bench/publish_overlap.py --mb 8 --n 2 --upload-mbps 0 --repeat 1
	$(PY) bench/cold_fetch.py --mb 8 --pairs 1 --processes 2
	$(PY) bench/waiters.py --n 3 --mb 4 --rounds 1 --idle-s 1
	$(PY) bench/small_compiles.py --programs 2 --pairs 1
	$(PY) bench/job_shapes.py --n 2 --rounds 1
	$(PY) bench/fanout.py --mb 8 --workers 3 --repeat 1
	$(PY) bench/decisions.py --clients 20 --seconds 2 --streams 2
	$(PY) bench/decisions.py --loadgen go --clients 50 --seconds 2 --streams 2 --rate 500 --components 11
	$(PY) bench/miss_storm.py --rate 100 --seconds 2
	$(PY) bench/records.py --rate 50 --seconds 2
	$(PY) bench/lease_takes.py --seconds 2
	$(PY) bench/renewals.py --count 20
	$(PY) bench/pod_start.py --processes 20 --programs 2 --compile-s 0.2
	$(PY) bench/pod_cold.py --hosts 60 --per-key-hosts 3 --per-key-programs 2 --programs 12 --fanout 4
	$(PY) bench/sweep.py --entries 100 --records
	$(PY) bench/listing.py --artifacts 300
	$(PY) bench/tracing_exit.py --repeat 1
	$(PY) bench/autotune_share.py --layers 2 --width 64 --pairs 1
	$(PY) bench/pjrt_wave.py --n 2
	$(PY) bench/pjrt_gate_flood.py --idle 100 --slow 2 --huge 1

clean:
	rm -rf $(STAMP) build *.egg-info .pytest_cache
