"""Process set-up for speed: which libraries a worker gets preloaded and which OpenMP knobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dejavu_cli.launcher import Child, Launcher
from dejavu_common.settings import EngineSettings, Settings
from dejavu_engine import process
from dejavu_engine.process import find_intel_openmp, find_tcmalloc, worker_environment


@pytest.fixture
def fake_libs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A tcmalloc and an Intel OpenMP that exist (empty files) where the finders look."""
    (tmp_path / "sys").mkdir()
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    tcmalloc = tmp_path / "sys" / "libtcmalloc_minimal.so.4"
    iomp = tmp_path / "venv" / "lib" / "libiomp5.so"
    tcmalloc.touch()
    iomp.touch()
    monkeypatch.setattr(process, "LIBRARY_DIRS", (str(tmp_path / "nothing"), str(tmp_path / "sys")))
    monkeypatch.setattr(process, "find_tcmalloc", lambda: find_tcmalloc(process.LIBRARY_DIRS))
    monkeypatch.setattr(process, "find_intel_openmp", lambda: find_intel_openmp([str(tmp_path / "venv")]))
    return tcmalloc, iomp


def test_finders_report_missing_libraries_as_none(tmp_path: Path) -> None:
    assert find_tcmalloc([str(tmp_path)]) is None
    assert find_intel_openmp([str(tmp_path)]) is None


def test_both_libraries_preloaded_in_front_of_an_existing_preload(fake_libs: tuple[Path, Path]) -> None:
    tcmalloc, iomp = fake_libs
    env = worker_environment(EngineSettings(), {"LD_PRELOAD": "/opt/other.so"})
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{iomp}:/opt/other.so"
    assert env["KMP_BLOCKTIME"] == "1"
    assert "OMP_PROC_BIND" not in env  # binding only where asked for


def test_each_preload_switched_off_by_its_setting(fake_libs: tuple[Path, Path]) -> None:
    tcmalloc, iomp = fake_libs
    no_omp = worker_environment(EngineSettings(preload_openmp=False), {})
    assert no_omp["LD_PRELOAD"] == str(tcmalloc)
    assert "KMP_BLOCKTIME" not in no_omp  # an Intel OpenMP knob without Intel OpenMP means nothing
    assert worker_environment(EngineSettings(preload_allocator=False), {})["LD_PRELOAD"] == str(iomp)
    assert worker_environment(EngineSettings(preload_allocator=False, preload_openmp=False), {}) == {}


def test_a_library_already_preloaded_is_not_repeated(fake_libs: tuple[Path, Path]) -> None:
    tcmalloc, iomp = fake_libs
    env = worker_environment(EngineSettings(), {"LD_PRELOAD": str(tcmalloc)})
    assert env["LD_PRELOAD"] == f"{iomp}:{tcmalloc}"


def test_binding_sets_openmp_places(fake_libs: tuple[Path, Path]) -> None:
    env = worker_environment(EngineSettings(openmp_bind=True, openmp_blocktime_ms=0), {})
    assert env["OMP_PROC_BIND"] == "close" and env["OMP_PLACES"] == "cores"
    assert env["KMP_BLOCKTIME"] == "0" and "compact" in env["KMP_AFFINITY"]


def test_launcher_preloads_into_workers_not_the_controller(fake_libs: tuple[Path, Path], tmp_path: Path) -> None:
    tcmalloc, _ = fake_libs
    launcher = Launcher(Settings(), pin_cpus=True, log_dir=tmp_path)
    controller = Child("controller", ["python"], restart=False)
    worker = Child("t0", ["python"], restart=True)
    launcher.children += [controller, worker]
    worker_env, controller_env = launcher._env(worker), launcher._env(controller)
    assert str(tcmalloc) in worker_env["LD_PRELOAD"]
    assert worker_env["OMP_PROC_BIND"] == "close"  # pinned workers own their cores: bind the threads too
    assert len(json.loads(worker_env["DEJAVU_ENGINE__CPU_AFFINITY"])) == 1
    assert str(tcmalloc) not in controller_env.get("LD_PRELOAD", "")


@pytest.mark.skipif(find_tcmalloc() is None or find_intel_openmp() is None, reason="tcmalloc or intel-openmp absent")
def test_preloaded_worker_runs_torch_and_reports_the_libraries() -> None:
    """The real libraries, preloaded as the launcher does, load and run torch's OpenMP work."""
    env = worker_environment(EngineSettings(), {})
    code = (
        "import torch; from dejavu_engine.process import describe_runtime; torch.set_num_threads(2);"
        "a = torch.randn(256, 256); assert torch.allclose(a @ a, (a.double() @ a.double()).float(), atol=1e-3);"
        "print(describe_runtime())"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**_base_env(), **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "tcmalloc" in out.stdout and "iomp5" in out.stdout


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def test_each_pipeline_divides_the_hosts_cores_among_its_own_stages(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))

    def threads(prompt_depth: int, token_depth: int, **engine: object) -> dict[str, int]:
        settings = Settings()
        controller = settings.controller.model_copy(update={"prompt_depth": prompt_depth, "token_depth": token_depth})
        settings = settings.model_copy(
            update={"controller": controller, "engine": settings.engine.model_copy(update=engine)}
        )
        launcher = Launcher(settings, log_dir=tmp_path)
        prompt = Child("p0", ["python", "-m", "dejavu_prompt_worker"], restart=True)
        token = Child("t0", ["python", "-m", "dejavu_token_worker"], restart=True)
        launcher.children += [prompt, token]
        return {c.name: int(launcher._env(c)["DEJAVU_ENGINE__TORCH_THREADS"]) for c in (prompt, token)}

    # One prompt and one token stage take turns on the host: each may use every core.
    assert threads(1, 1) == {"p0": cores, "t0": cores}
    # Stages of one pipeline run together: they share the cores (at least one thread each).
    assert threads(1, 2 * cores) == {"p0": cores, "t0": 1}
    assert threads(1, 1, torch_threads=3) == {"p0": 3, "t0": 3}  # a setting wins


_RELEASE_PROBE = """
import json, resource, sys, torch
from dejavu_engine.process import release_free_memory

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20

base = rss_mb()
blocks = [torch.ones(4 << 20) for _ in range(25)]  # 25 x 16 MB, touched
peak = rss_mb()
del blocks
freed = rss_mb()
which = release_free_memory()
print(json.dumps({"base": base, "peak": peak, "freed": freed, "released": rss_mb(), "which": which}))
"""


@pytest.mark.parametrize("preload", [True, False], ids=["tcmalloc", "glibc"])
def test_freed_memory_goes_back_to_the_os_when_released(preload: bool) -> None:
    """What a worker frees (a finished request's KV) leaves its RSS once released, with tcmalloc
    preloaded (which keeps freed pages for reuse) and with glibc's allocator."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    tcmalloc = find_tcmalloc()
    if preload:
        if tcmalloc is None:
            pytest.skip("tcmalloc is not installed here")
        env["LD_PRELOAD"] = str(tcmalloc)
    out = subprocess.run([sys.executable, "-c", _RELEASE_PROBE], env=env, capture_output=True, text=True, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["which"] == ("tcmalloc" if preload else "glibc")
    assert m["peak"] - m["base"] > 350  # the 400 MB were resident
    assert m["released"] - m["base"] < 100, m  # and are gone after the release


def test_memory_is_released_only_once_the_worker_was_quiet_after_freeing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(process, "release_free_memory", lambda: calls.append(1) or "glibc")
    clock = [100.0]
    monkeypatch.setattr(process.time, "monotonic", lambda: clock[0])
    releaser = process.MemoryReleaser(quiet_s=2.0)
    assert not releaser.maybe_release()  # nothing freed yet
    releaser.freed()
    clock[0] += 1.0
    assert not releaser.maybe_release()  # not quiet long enough
    clock[0] += 1.5
    assert not releaser.maybe_release(idle=False)  # still holding work
    with releaser.busy():
        clock[0] += 5.0
        assert not releaser.maybe_release()  # a task runs
    clock[0] += 2.5
    assert releaser.maybe_release() and calls == [1]
    assert not releaser.maybe_release()  # once per free


def test_a_worker_never_quiet_still_releases_between_tasks_every_so_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tasks back to back (a prompt worker under steady traffic) never leave ``quiet_s``: the allocator's
    freed memory still goes back every ``every_s``, between two tasks, never during one."""
    calls: list[int] = []
    monkeypatch.setattr(process, "release_free_memory", lambda: calls.append(1) or "tcmalloc")
    clock = [100.0]
    monkeypatch.setattr(process.time, "monotonic", lambda: clock[0])
    releaser = process.MemoryReleaser(quiet_s=2.0, every_s=30.0)
    for _ in range(29):  # a task a second for 29 s: never quiet, not yet time
        with releaser.busy():
            clock[0] += 0.9
        clock[0] += 0.1
        assert not releaser.maybe_release()
    with releaser.busy():
        clock[0] += 1.0
        assert not releaser.maybe_release()  # time, but a task runs
    assert releaser.maybe_release() and calls == [1]  # between two tasks
    with releaser.busy():
        clock[0] += 1.0
    assert not releaser.maybe_release() and calls == [1]  # the next one only after another every_s
    assert not releaser.maybe_release(idle=False)  # a worker holding state keeps to the quiet rule


def test_openmp_registration_files_of_processes_that_are_gone_are_removed(tmp_path: Path) -> None:
    """Intel OpenMP's /dev/shm file of a SIGKILLed process stays for good; a starting worker removes those
    of dead processes and keeps the live ones' and anything else."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getpid()
    for name in (
        f"__KMP_REGISTERED_LIB_{dead.pid}_0",
        f"__KMP_REGISTERED_LIB_{dead.pid}",
        f"__KMP_REGISTERED_LIB_{live}_0",
    ):
        (tmp_path / name).write_bytes(b"0x7f-cafe-libiomp5.so")
    (tmp_path / "unrelated").write_bytes(b"x")
    assert process.sweep_openmp_registrations(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"__KMP_REGISTERED_LIB_{live}_0", "unrelated"]
    assert process.sweep_openmp_registrations(tmp_path / "missing") == 0
