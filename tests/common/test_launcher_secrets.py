"""What ``dejavu up`` does with secrets: a private run directory, an admin key pair of which children get
only the public half, and a Redis password that never appears on a command line."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
import redis
from pydantic import SecretStr

from dejavu_cli import launcher as launcher_module
from dejavu_cli.launcher import ADMIN_KEY_NAME, Launcher, stop_from_state_file, terminate_all
from dejavu_cli.rundir import UnsafePathError, read_private, run_dir, write_private
from dejavu_common.admin import AdminRejected, CommandVerifier, sign
from dejavu_common.messages import AdminAction
from dejavu_common.settings import DEV_DATA_PLANE_SECRET, Settings


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    (tmp_path / "runtime").mkdir(mode=0o700)
    return tmp_path / "runtime"


def test_run_dir_is_private_and_checked(runtime_dir: Path):
    path = run_dir()
    assert path == runtime_dir / "dejavu"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    path.chmod(0o777)  # e.g. made by someone else, or loosened
    with pytest.raises(UnsafePathError, match="open to group or others"):
        run_dir()
    path.rmdir()
    (runtime_dir / "elsewhere").mkdir(mode=0o700)
    path.symlink_to(runtime_dir / "elsewhere")  # a planted link
    with pytest.raises(UnsafePathError, match="symlink"):
        run_dir()


def test_private_files(runtime_dir: Path):
    path = run_dir() / "x.json"
    write_private(path, "{}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_private(path) == "{}"
    path.chmod(0o644)
    with pytest.raises(UnsafePathError):
        read_private(path)
    assert read_private(run_dir() / "absent") is None


def test_a_planted_state_file_is_not_obeyed(runtime_dir: Path):
    state = run_dir() / launcher_module.STATE_NAME
    state.write_text('{"launcher": 1, "pids": [1]}')
    state.chmod(0o666)
    with pytest.raises(UnsafePathError):
        stop_from_state_file()  # never signals PIDs from a file another user could have written


def test_children_get_the_verify_key_only(runtime_dir: Path):
    launcher = Launcher(Settings())
    launcher._ensure_secrets()
    admin = launcher.settings.admin
    assert admin.signing_key is not None and admin.verify_key is not None
    env = launcher._env(launcher_module.Child("t0", [], restart=True))
    assert env["DEJAVU_ADMIN__VERIFY_KEY"] == admin.verify_key
    assert "DEJAVU_ADMIN__SIGNING_KEY" not in env
    assert admin.signing_key.get_secret_value() not in env.values()
    key_file = run_dir() / ADMIN_KEY_NAME
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key_file.read_text().strip() == f"DEJAVU_ADMIN__SIGNING_KEY={admin.signing_key.get_secret_value()}"
    assert env["DEJAVU_TRANSPORT__SECRET"] not in ("", DEV_DATA_PLANE_SECRET)  # a fresh one per deployment
    verifier = CommandVerifier(admin.verify_key, "t0", "i", max_ttl_s=30, max_pause_s=60, clock_skew_s=5)
    verifier.check(sign(admin.signing_key.get_secret_value(), "t0", "i", AdminAction.DRAIN))
    with pytest.raises(AdminRejected):  # what a child holds cannot sign
        verifier.check(sign(env["DEJAVU_ADMIN__VERIFY_KEY"], "t0", "i", AdminAction.DRAIN))


def test_configured_admin_keys_are_kept(runtime_dir: Path):
    settings = Settings(admin={"verify_key": "A" * 43 + "="})
    launcher = Launcher(settings)
    launcher._ensure_secrets()
    assert launcher.settings.admin.verify_key == "A" * 43 + "="
    assert not (run_dir() / ADMIN_KEY_NAME).exists()


def test_the_local_redis_password_is_not_on_its_command_line(runtime_dir: Path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    password = "pw-" + os.urandom(8).hex()
    settings = Settings(redis={"url": f"redis://127.0.0.1:{port}/0", "password": SecretStr(password)})
    launcher = Launcher(settings)
    launcher._ensure_redis()
    try:
        assert launcher.redis_proc is not None
        cmdline = Path(f"/proc/{launcher.redis_proc.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline
        config = run_dir() / f"redis-{port}.conf"
        assert stat.S_IMODE(config.stat().st_mode) == 0o600
        assert launcher_module._redis_answers(settings.redis.url, settings)  # the password is in force
        assert not launcher_module._redis_answers(settings.redis.url)
        # A memory bound without eviction: a full Redis refuses writes instead of dropping leases.
        client = redis.Redis.from_url(settings.redis.url, password=password)
        try:
            assert int(client.config_get("maxmemory")["maxmemory"]) == 256 * 2**20
            assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        finally:
            client.close()
    finally:
        terminate_all([launcher.redis_proc])


def test_dejavu_admin_signs_with_the_key_dejavu_up_made(runtime_dir: Path, redis_url, monkeypatch) -> None:
    from dejavu_cli.main import main as dejavu
    from dejavu_common import keys
    from dejavu_common.messages import AdminCommand, WorkerInfo, WorkerRole

    monkeypatch.delenv("DEJAVU_ADMIN__SIGNING_KEY", raising=False)
    launcher = Launcher(Settings())
    launcher._ensure_secrets()  # what `dejavu up` does: the signing key lands in the run directory only
    client = redis.Redis.from_url(redis_url)
    info = WorkerInfo(worker_id="t0", role=WorkerRole.TOKEN, host="h", pid=1, instance="i0", data_address="")
    client.hset(keys.worker("t0"), mapping={"info": info.encode()})
    client.sadd(keys.WORKERS, "t0")
    assert dejavu(["admin", "--redis-url", redis_url, "drain", "t0"]) == 0
    ((_id, fields),) = client.xrange(keys.ADMIN_STREAM)
    verify = launcher.settings.admin.verify_key
    CommandVerifier(verify, "t0", "i0", max_ttl_s=30, max_pause_s=60, clock_skew_s=5).check(
        AdminCommand.decode(fields[b"cmd"])
    )
