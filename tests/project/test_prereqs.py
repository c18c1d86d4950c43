"""`make test` on a fresh machine: what the suite needs besides Python is checked first
(hack/prereqs.sh), and a missing piece stops it with one line saying how to install it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "prereqs.sh"


def run_prereqs(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The script with a PATH of just bash and id: no apt-get to install anything with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "id"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return subprocess.run(
        [str(bin_dir / "bash"), str(SCRIPT), *args],
        env={"PATH": str(bin_dir), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_missing_chromium_stops_with_one_line_naming_it_and_how_to_install_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-chromium-here"
    done = run_prereqs(tmp_path, GPUPLANE_CHROMIUM=str(missing))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(missing) in lines[0]
    assert "browser tests" in lines[0]
    assert "apt-get install -y chromium" in lines[0]


def test_present_chromium_passes_quietly(tmp_path: Path) -> None:
    chromium = tmp_path / "chromium"
    chromium.write_text("#!/bin/sh\n")
    chromium.chmod(0o755)
    done = run_prereqs(tmp_path, GPUPLANE_CHROMIUM=str(chromium))
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_make_test_checks_the_prerequisites_before_building_or_running_anything() -> None:
    """The check comes first: before the venv is made (a minute on a fresh machine) and the suite."""
    for target, check in (("test", "hack/prereqs.sh"), ("test-postgres", "hack/prereqs.sh postgres")):
        plan = subprocess.run(
            ["make", "-n", "-B", target, "PYTHON=python3"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            # Not as a sub-make of the `make test` that may be running this: no "Entering directory".
            env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")} | {"VENV": str(ROOT / ".venv")},
        ).stdout.splitlines()
        assert plan[0] == check, plan
        assert any("pytest" in line for line in plan[1:])


def test_a_second_build_of_the_same_go_cache_waits_for_the_first(tmp_path: Path) -> None:
    """Two callers of the Go build scripts at once (``make test`` beside a bench) share the work:
    the second waits for the first's lock and then finds its result, instead of compiling the
    same packages on the same cores. Shown on ``one_builder`` of hack/go-env.sh with a stand-in
    build that records when it ran."""
    cache = tmp_path / "kube-bin" / "abc"
    log = tmp_path / "log"
    build = (
        f". {ROOT / 'hack' / 'go-env.sh'}; one_builder {cache}; "
        f'if [ -e {cache} ]; then echo "$1 found" >> {log}; exit 0; fi; '
        f'echo "$1 builds" >> {log}; sleep 1; mkdir -p {cache}'
    )
    first = subprocess.Popen(["bash", "-c", build, "-", "first"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    second = subprocess.run(
        ["bash", "-c", build, "-", "second"], capture_output=True, text=True, timeout=30, check=True
    )
    first.communicate(timeout=30)
    assert log.read_text().splitlines() == ["first builds", "second found"]
    assert "another build of abc is running; waiting for it" in second.stderr
