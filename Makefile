# gpuplane: `make demo` (embedded: SQLite, tasks in-process) and `make test`.
# Python >= 3.12 is needed (Django 6); the first one found is used.

PYTHON ?= $(shell for p in python3.13 python3.12 /root/.pyenv/versions/3.13.0/bin/python3 /root/.pyenv/versions/3.12.1/bin/python3 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1 && { command -v $$p; break; }; done)
VENV ?= .venv
PY := $(VENV)/bin/python
PG_URL ?= postgres://postgres@127.0.0.1:5432/gpuplane
ADDRPORT ?= 127.0.0.1:8000

.PHONY: demo test test-postgres lint check serve clean

$(VENV)/.runtime: requirements.txt
	@test -n "$(PYTHON)" || { echo "error: Python >= 3.12 not found; set PYTHON=/path/to/python3.12" >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	@touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	@touch $@

## demo: check $(ADDRPORT) is free, then migrate a SQLite database, load deploy/demo/cluster.yaml, place it,
## serve on $(ADDRPORT) (another: make demo ADDRPORT=127.0.0.1:8001)
demo: $(VENV)/.runtime
	$(PY) manage.py demo --serve --addrport $(ADDRPORT)

# The suite runs on TEST_WORKERS processes (pytest-xdist; most tests wait on servers,
# workers and sockets, so two share the 2-core machine well); TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

## kube-bin: build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, helm and promtool from the
## pinned Go modules in hack/kube (cached outside the repo by go.sum's hash; nothing to do when built;
## KUBEBUILDER_ASSETS=DIR uses envtest's binaries instead), KubeVirt's virt-controller and manifests from
## hack/kubevirt, and kwok from hack/kwok
.PHONY: kube-bin
kube-bin:
	@hack/kube-bin.sh >/dev/null
	@hack/kubevirt-bin.sh >/dev/null
	@hack/kwok-bin.sh >/dev/null

# The cluster tests run on the real control plane: build it first (once). Without Go or
# KUBEBUILDER_ASSETS the rest of the suite still runs and each cluster test fails with one
# line saying how to get the binaries.
.PHONY: kube-bin-for-tests
kube-bin-for-tests:
	@hack/kube-bin.sh >/dev/null || echo "warning: no control-plane binaries: the cluster tests will fail (install Go >= 1.26 and run make kube-bin, or set KUBEBUILDER_ASSETS)" >&2
	@hack/kubevirt-bin.sh >/dev/null || echo "warning: no KubeVirt CRDs or virt-controller: the cluster tests will fail (install Go >= 1.26 and run make kube-bin)" >&2
	@hack/kwok-bin.sh >/dev/null || echo "warning: no kwok: the VM lifecycle tests will fail (install Go >= 1.26 and run make kube-bin)" >&2

## services: start PostgreSQL and Redis on this machine when they are not running (root; hack/services.sh)
.PHONY: services
services:
	hack/services.sh

# What the suite needs besides Python, checked before anything is built (hack/prereqs.sh).
.PHONY: prereqs prereqs-postgres
prereqs:
	@hack/prereqs.sh
prereqs-postgres:
	@hack/prereqs.sh postgres

## test: the whole suite on SQLite (set DATABASE_URL to run it on PostgreSQL)
test: prereqs $(VENV)/.dev kube-bin-for-tests
	$(PYTEST)

## test-postgres: the whole suite on the local PostgreSQL; skips count as failures
test-postgres: prereqs-postgres $(VENV)/.dev kube-bin-for-tests
	DATABASE_URL=$(PG_URL) GPUPLANE_FORBID_SKIPS=1 $(PYTEST)

## check-docs: every command, Make target, bench flag and link the docs show exists; the settings table is complete
.PHONY: check-docs
check-docs: $(VENV)/.dev
	$(PY) -m pytest -p no:cacheprovider tests/project/test_docs.py tests/project/test_settings_doc.py

## lint: ruff, the import contracts (.importlinter, see docs/architecture.md) and mypy --strict
lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy

## chart-docs: what is generated from charts/gpuplane (deploy/base, the dashboards' JSON, the values
## table and panel list in docs/operations.md); tests/project/test_chart.py fails when they are stale
.PHONY: chart-docs
chart-docs: $(VENV)/.dev
	$(PY) hack/chart.py all

## import-graph: modules, edges, binder's edges into other apps, and import cycles (docs/architecture.md)
.PHONY: import-graph
import-graph: $(VENV)/.dev
	$(PY) docs/import_graph.py

check: lint test test-postgres

## serve-tls: serve over HTTPS with gunicorn (deploy/gunicorn.conf.py) on $(TLS_BIND), with a
## development certificate from `manage.py webhook_cert --local` in $(TLS_DIR) (made if missing)
TLS_DIR ?= var/tls
TLS_BIND ?= 127.0.0.1:8443
.PHONY: serve-tls
serve-tls: $(VENV)/.runtime
	@test -f $(TLS_DIR)/tls.crt || $(PY) manage.py webhook_cert --local --out $(TLS_DIR)
	$(PY) manage.py migrate --verbosity 0
	GPUPLANE_TLS_CERT_FILE=$(TLS_DIR)/tls.crt GPUPLANE_TLS_KEY_FILE=$(TLS_DIR)/tls.key GPUPLANE_BIND=$(TLS_BIND) \
		$(VENV)/bin/gunicorn -c deploy/gunicorn.conf.py gpuplane.wsgi

## serve-webhook: the VMI webhook alone on its own server (deploy/webhook_server.py), plain HTTP on 127.0.0.1:8001
.PHONY: serve-webhook
serve-webhook: $(VENV)/.runtime
	$(PY) manage.py migrate --verbosity 0
	$(PY) deploy/webhook_server.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
