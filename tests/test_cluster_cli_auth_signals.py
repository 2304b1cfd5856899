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


# -- a notebook's `connect()` -------------------------------------------------------------------------------

# A notebook that imported Ray (nothing exported) before it joins the cluster with d9d; `before` runs in
# between, as a later cell would.
_NOTEBOOK = """
import os, sys
import ray
{before}
from d9d.cluster import connect
try:
    connect(sys.argv[1] or None)  # none: the local instance connect starts
except ConnectionError as e:
    print(f"refused: {{type(e).__name__}}: {{e}}")
    sys.exit(3)
print("joined", ray.is_initialized())
"""


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_a_notebook_that_imported_ray_first_joins_a_cluster_with_token_authentication(
    tmp_path: Path, local_instance: tuple[str, Path]
) -> None:
    """Ray reads RAY_AUTH_MODE when it is imported: a notebook that imported it before anyone set the
    variable was refused ("Failed to connect to Ray cluster", after Ray's retries) whatever it set later,
    `connect()` included. Now `connect()` sends the token at hand and has Ray read its configuration again;
    a refusal all the same is one line that says what to do."""
    address, home = local_instance
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    token = (home / ".ray" / "auth_token").read_text().strip()
    cases = {
        # the token in ~/.ray/auth_token, RAY_AUTH_MODE unset
        "token file": (home, {}, ""),
        # RAY_AUTH_MODE=token set by a cell after `import ray`: too late for Ray alone
        "mode set after import": (
            stranger,
            {"RAY_AUTH_TOKEN": token},
            "os.environ['RAY_AUTH_MODE'] = 'token'",
        ),
        "no token": (stranger, {}, ""),
        "wrong token": (stranger, {"RAY_AUTH_TOKEN": "0" * 64}, ""),
        "auth disabled": (home, {"RAY_AUTH_MODE": "disabled"}, ""),
        # `connect()` starting a local instance: Ray starts it with token authentication, and must then
        # send a token itself
        "local, mode set after import": (tmp_path / "local", {}, "os.environ['RAY_AUTH_MODE'] = 'token'"),
    }
    (tmp_path / "local").mkdir()
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-c",
                _NOTEBOOK.format(before=before),
                "" if name.startswith("local") else address,
            ],
            env={**_user_env(where), **extra},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (where, extra, before) in cases.items()
    }
    said = {name: proc.communicate(timeout=200) for name, proc in procs.items()}
    codes = {name: proc.returncode for name, proc in procs.items()}

    for name in ("token file", "mode set after import", "local, mode set after import"):
        assert codes[name] == 0 and said[name][0].strip() == "joined True", (name, said[name][1][-3000:])
    refused = f"refused: RayAuthRefused: the Ray cluster at {address} requires token authentication and "
    refused += "refused this client: "
    for name in ("no token", "wrong token", "auth disabled"):
        assert codes[name] == 3, (name, said[name])
        assert "Traceback" not in said[name][0] + said[name][1]
    assert said["no token"][0].strip() == refused + (
        "no token here; put the cluster's token (`ray get-auth-token` on the head prints it) in "
        "RAY_AUTH_TOKEN or ~/.ray/auth_token here"
    )
    assert said["wrong token"][0].strip() == refused + (
        "the token in RAY_AUTH_TOKEN is not the cluster's (`ray get-auth-token` on the head prints it; put "
        "it there or in RAY_AUTH_TOKEN)"
    )
    assert said["auth disabled"][0].strip() == refused + (
        "RAY_AUTH_MODE=disabled here; set RAY_AUTH_MODE=token (or unset it) with the cluster's token in "
        "RAY_AUTH_TOKEN or ~/.ray/auth_token"
    )


def test_the_token_decision(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """When a d9d driver turns Ray's token authentication on, and what a refusal tells the user."""
    from d9d.cluster import auth

    for name in _AUTH_VARIABLES:
        # Set first, so that the undo removes what the test sets (delenv of an absent variable records
        # nothing): a RAY_AUTH_MODE left behind would reach the next test's `ray.init` in this process.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert auth.token_source() is None and not auth.use_token_at_hand()
    assert "RAY_AUTH_MODE" not in os.environ

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    assert auth.token_source() == str(tmp_path / ".ray" / "auth_token")
    assert auth.use_token_at_hand() and os.environ["RAY_AUTH_MODE"] == "token"

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's choice: left alone
    assert not auth.use_token_at_hand() and os.environ["RAY_AUTH_MODE"] == "disabled"
    assert auth.token_source({"RAY_AUTH_TOKEN": "x"}) == "RAY_AUTH_TOKEN"
    path = tmp_path / "elsewhere"
    assert auth.token_source({"RAY_AUTH_TOKEN_PATH": str(path)}) is None  # named, but not there
    path.write_text("t")
    assert auth.token_source({"RAY_AUTH_TOKEN_PATH": str(path)}) == str(path)

    # A Ray imported before the mode was set, that could not be made to read it again: say what to do.
    advice = auth.advice(ray_follows=False, env={"RAY_AUTH_MODE": "token"})
    assert "set it before importing ray or d9d.cluster" in advice and "restart the kernel" in advice
    assert auth.auth_refused(auth.RayAuthRefused("x")) and not auth.auth_refused(ConnectionError("x"))


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
