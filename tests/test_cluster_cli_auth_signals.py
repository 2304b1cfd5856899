"""The `d9d` commands against a real Ray instance, as a user's shell meets them: a local instance started
the way `d9d train` starts one (Ray turns token authentication on whenever RAY_AUTH_MODE is unset) joined
by a later `d9d` command with nothing exported, and SIGINT/SIGTERM reaching the driver while it waits
inside Ray (where it spends most of a run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from d9d.cli import exit_codes

_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


def _user_env(home: Path) -> dict[str, str]:
    """A shell with nothing Ray-specific exported, whose home is `home` (where Ray keeps its token)."""
    env = {k: v for k, v in os.environ.items() if k not in _AUTH_VARIABLES}
    # Fail fast where a join is refused: Ray retries a refused join for 20 s by default.
    return {**env, "HOME": str(home), "RAY_NUM_REDIS_GET_RETRIES": "2"}


@pytest.fixture
def local_instance(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A local Ray instance started as `d9d train` starts one (`ray.init(address="local")`, RAY_AUTH_MODE
    unset), in a process of its own; its GCS address and the home directory where Ray put the token."""
    home = tmp_path / "home"
    home.mkdir()
    script = (
        "import sys, ray\n"
        "ray.init(address='local', num_cpus=0, include_dashboard=False)\n"
        "print(ray.get_runtime_context().gcs_address, flush=True)\n"
        "sys.stdin.read()\n"
        "ray.shutdown()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env=_user_env(home),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, "the local Ray instance did not start"
        yield address, home
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the script shuts its instance down
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_d9d_joins_a_local_instance_with_token_authentication_without_anything_exported(
    tmp_path: Path, local_instance: tuple[str, Path]
) -> None:
    """`d9d status/stop/logs RUN` of a running `d9d train` join its Ray instance by the address in
    `run.json`; Ray sends that instance's token only when RAY_AUTH_MODE=token says so, which nobody had
    exported: every such command was refused ("Authentication token is missing or incorrect") after 20 s
    of retries, with a traceback. `d9d list --address` takes the same path."""
    address, home = local_instance
    assert (home / ".ray" / "auth_token").is_file()  # Ray made the instance authenticate, with this token
    runs = tmp_path / "runs"
    runs.mkdir()

    def d9d_list(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "d9d.cli.main", "list", "--runs-root", str(runs), "--address", address],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=180,
        )

    joined = d9d_list(_user_env(home))
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert joined.stdout.startswith("RUN "), joined.stdout

    # Without the token (another machine, another user): refused, said in one line, no traceback.
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    refused = d9d_list(_user_env(stranger))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert "requires token authentication" in refused.stderr and "RAY_AUTH_TOKEN" in refused.stderr

    # An explicit RAY_AUTH_MODE is the user's choice and is left alone.
    disabled = d9d_list({**_user_env(home), "RAY_AUTH_MODE": "disabled"})
    assert disabled.returncode == 2 and "requires token authentication" in disabled.stderr


@ray.remote(num_cpus=0)
def _sleep(seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.ray
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("_ray")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_driver_waits_inside_ray_stops_the_run_at_a_step_boundary(
    monkeypatch: pytest.MonkeyPatch, signum: signal.Signals
) -> None:
    """`follow()` spends its time in `ray.get` (the coordinator's long polls). A signal there ran the
    handler inside Ray's wait, which lets only a KeyboardInterrupt through; the handler's own exception was
    left pending and surfaced as a SystemError: the driver died with a traceback, its local Ray instance
    and the run with it, the summary still saying `starting`. Now it asks the run to stop at the next step
    boundary and exits with PREEMPTED, whichever of the two signals it was."""
    import d9d.cluster.follow
    from d9d.cli.commands.train import follow_preemptible

    waiting = _sleep.remote(60)

    def follow(job: Any) -> Any:
        threading.Timer(1.0, os.kill, (os.getpid(), signum)).start()
        ray.get(waiting)  # where the driver waits, as follow's polls do
        raise AssertionError("the signal did not interrupt the wait")

    stopped: list[str] = []

    def checkpoint_and_stop(grace_s: float, reason: str) -> SimpleNamespace:
        stopped.append(reason)
        return SimpleNamespace(status="stopped", steps=7, stop_reason=reason, error=None)

    job = SimpleNamespace(
        run_name="r",
        spec=SimpleNamespace(cluster=SimpleNamespace(preemption_grace_s=25.0), run_dir=Path("runs/r")),
        checkpoint_and_stop=checkpoint_and_stop,
        coordinator_lost=False,
    )
    monkeypatch.setattr(d9d.cluster.follow, "follow", follow)
    before = signal.getsignal(signum)
    try:
        assert follow_preemptible(job, "train") == exit_codes.PREEMPTED  # type: ignore[arg-type]
    finally:
        ray.cancel(waiting, force=True)
    assert stopped == [f"preempted: {signum.name} to the driver"]
    assert signal.getsignal(signum) == before  # the previous handler is back
