"""The chart's objects against the test control plane (harness/controlplane/), where no
kubelet runs: the webhook server started with the environment and mounts of the rendered
Deployment, the rendered registration pointed at it, and the chart's hook Jobs run by the test
(their container's command in this process's Python, as the Job's ServiceAccount) and then
marked complete, so ``helm install``/``upgrade`` go on as on a real cluster.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from harness.chart_tools import CHART, run, tool
from harness.controlplane import ApiError, ControlPlane

ROOT = Path(__file__).resolve().parents[1]
VMIS = "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances"


def render(release: str, namespace: str, *sets: str) -> list[dict[str, Any]]:
    args = [tool("helm"), "template", release, str(CHART), "--namespace", namespace]
    for item in sets:
        args += ["--set", item]
    return [d for d in yaml.safe_load_all(run(*args).stdout) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container_env(deployment: dict[str, Any], mounts: dict[str, Path], base: dict[str, str]) -> dict[str, str]:
    """The webhook container's environment as the kubelet would give it, with every path under a
    mounted volume replaced by the local directory standing for that volume (``mounts``: volume
    name -> directory). Values from Secrets the test does not make are left out."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    paths = {m["mountPath"]: mounts[m["name"]] for m in container["volumeMounts"] if m["name"] in mounts}
    env = dict(base)
    for item in container["env"]:
        if "value" not in item:
            continue
        value = item["value"]
        for mount_path, local in paths.items():
            if value.startswith(mount_path + "/"):
                value = str(local / value.removeprefix(mount_path + "/"))
        env[item["name"]] = value
    return env


def secret_volumes(deployment: dict[str, Any]) -> dict[str, str]:
    """Volume name -> the Secret it mounts."""
    return {
        v["name"]: v["secret"]["secretName"] for v in deployment["spec"]["template"]["spec"]["volumes"] if "secret" in v
    }


def register(plane: ControlPlane, configuration: dict[str, Any], url: str) -> dict[str, Any]:
    """The rendered MutatingWebhookConfiguration, pointed at ``url`` with the test CA's bundle
    (everything else, matchConditions included, as rendered)."""
    hook = configuration["webhooks"][0]
    hook["clientConfig"] = {
        "url": f"{url}/webhooks/vmi",
        "caBundle": base64.b64encode(plane.pki.ca_file.read_bytes()).decode(),
    }
    return dict(plane.apply(configuration))


def create_vmi(plane: ControlPlane, vmi: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
    body = {k: v for k, v in vmi.items() if k != "status"}
    body["metadata"] = {k: v for k, v in vmi["metadata"].items() if v is not None}
    query = "?dryRun=All" if dry_run else ""
    return dict(plane.request("POST", VMIS.format(ns=vmi["metadata"]["namespace"]) + query, body))


# -- hook Jobs ------------------------------------------------------------------------------------


def service_account_kubeconfig(plane: ControlPlane, namespace: str, account: str, directory: Path) -> Path:
    """A kubeconfig holding a token the apiserver issues for the ServiceAccount (TokenRequest),
    so a hook's command runs with exactly the rights the chart gives it."""
    issued = plane.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}},
    )
    path = directory / f"kubeconfig-{namespace}-{account}"
    cluster = {"server": plane.url, "certificate-authority": str(plane.pki.ca_file)}
    path.write_text(
        yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": account, "user": {"token": issued["status"]["token"]}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": account}}],
            "current-context": "test",
        })
    )  # fmt: skip
    return path


class HookRunner:
    """Runs each Job of ``release`` the moment it appears, as the kubelet would run its pod: its
    container's command with this checkout's Python (the image's ``python`` with ``/app`` as
    the working directory), as the Job's ServiceAccount, its ConfigMap volumes as local files;
    then writes the Job's status Complete (or Failed), which is what Helm waits for."""

    def __init__(self, plane: ControlPlane, namespace: str, release: str, workdir: Path) -> None:
        self.plane, self.namespace, self.release, self.workdir = plane, namespace, release, workdir
        self.ran: list[tuple[str, int, str]] = []  # (job, exit code, output)
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hook-runner", daemon=True)
        self.error: BaseException | None = None
        #: Also stand in for the Deployment controller and the kubelets: every Deployment of
        #: the release reported rolled out (``kubectl rollout status`` waits for that).
        self.roll_out = False

    def __enter__(self) -> HookRunner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self.roll_out:
                    self._roll_out()
                jobs = self.plane.request(
                    "GET",
                    f"/apis/batch/v1/namespaces/{self.namespace}/jobs?labelSelector=app.kubernetes.io/instance%3D{self.release}",
                )["items"]
                for job in jobs:
                    if job["metadata"]["uid"] not in self._seen and not (job.get("status") or {}).get("conditions"):
                        self._seen.add(job["metadata"]["uid"])
                        self.run_job(job)
                time.sleep(0.2)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _roll_out(self) -> None:
        deployments = self.plane.request(
            "GET",
            f"/apis/apps/v1/namespaces/{self.namespace}/deployments?labelSelector=app.kubernetes.io/instance%3D{self.release}",
        )["items"]
        for deployment in deployments:
            replicas = deployment["spec"].get("replicas", 1)
            status = deployment.get("status") or {}
            if status.get("observedGeneration") == deployment["metadata"]["generation"]:
                continue
            counts = dict.fromkeys(("replicas", "updatedReplicas", "readyReplicas", "availableReplicas"), replicas)
            path = f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{deployment['metadata']['name']}/status"
            with contextlib.suppress(ApiError):  # changed meanwhile: the next round
                self.plane.request(
                    "PATCH", path, {"status": {**counts, "observedGeneration": deployment["metadata"]["generation"]}}
                )

    def run_job(self, job: dict[str, Any]) -> None:
        spec = job["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        scratch = self.workdir / f"job-{job['metadata']['name']}-{len(self.ran)}"
        scratch.mkdir(parents=True)
        command = list(container["command"])
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                local = scratch / mount["name"]
                local.mkdir()
                data = self.plane.request(
                    "GET", f"/api/v1/namespaces/{self.namespace}/configmaps/{volume['configMap']['name']}"
                )["data"]
                for key, text in data.items():
                    (local / key).write_text(text)
                command = [str(local) if part == mount["mountPath"] else part for part in command]
        assert command[0] == "python", command
        kubeconfig = service_account_kubeconfig(self.plane, self.namespace, spec["serviceAccountName"], scratch)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "GPUPLANE_KUBE"))}
        env["KUBECONFIG"] = str(kubeconfig)
        done = subprocess.run(
            [sys.executable, *command[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
        )  # fmt: skip
        self.ran.append((job["metadata"]["name"], done.returncode, done.stdout + done.stderr))
        self._finish(job, done.returncode == 0)

    def _finish(self, job: dict[str, Any], succeeded: bool) -> None:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        kind = "Complete" if succeeded else "Failed"
        criteria = "SuccessCriteriaMet" if succeeded else "FailureTarget"
        status = {
            "startTime": now,
            "conditions": [
                {"type": criteria, "status": "True", "lastProbeTime": now, "lastTransitionTime": now},
                {"type": kind, "status": "True", "lastProbeTime": now, "lastTransitionTime": now},
            ],
            ("succeeded" if succeeded else "failed"): 1,
        }
        if succeeded:
            status["completionTime"] = now
        path = f"/apis/batch/v1/namespaces/{self.namespace}/jobs/{job['metadata']['name']}/status"
        self.plane.request("PATCH", path, {"status": status})


@contextlib.contextmanager
def hooks_run(
    plane: ControlPlane, namespace: str, release: str, workdir: Path, *, roll_out: bool = False
) -> Iterator[HookRunner]:
    runner = HookRunner(plane, namespace, release, workdir)
    runner.roll_out = roll_out
    with runner:
        yield runner
    if runner.error is not None:
        raise runner.error


def helm_env(kubeconfig: Path | str, home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }


def tools_on_path(directory: Path) -> dict[str, str]:
    """PATH with helm and kubectl (the pinned builds) first, for a docs block run as written."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("helm", "kubectl"):
        link = directory / name
        if not link.exists():
            link.symlink_to(tool(name))
    return {"PATH": f"{directory}{os.pathsep}{os.environ.get('PATH', '')}"}


def secret_data(plane: ControlPlane, namespace: str, name: str) -> dict[str, bytes]:
    secret = plane.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
    return {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}


def wait_for(check: Any, timeout: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = check()
        except ApiError:
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.2)
