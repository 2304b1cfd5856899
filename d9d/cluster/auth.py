"""Ray's token authentication (Ray >= 2.5x) for the drivers d9d starts: the `d9d` commands and `connect()`.

Ray starts a local instance with token authentication whenever RAY_AUTH_MODE is unset (`ray.init()`, and
`d9d train` without --address), but a driver that joins a cluster by its address sends no token unless
RAY_AUTH_MODE=token says so, and Ray reads that variable when it is imported. A notebook that imported
Ray before anyone set it was refused with nothing but "Failed to connect to Ray cluster" after 20 s of
retries, or "ray client connection timeout" (`ray://`).

So a d9d driver, before it joins a cluster by its address: with RAY_AUTH_MODE unset and a token at hand
where Ray looks for one (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) sets RAY_AUTH_MODE=token
for this process (a cluster without authentication accepts such a client as well; an explicit
RAY_AUTH_MODE is left alone); and when Ray was imported before the variable said what it says now, has
Ray read its configuration again, as `ray.init` itself does when it turns token authentication on for a
local instance. When the cluster refuses the client all the same, `refusal` says why and what to do, in
one line. Nothing here imports Ray at module level: the command line's quick paths import this module.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

AUTH_MODE = "RAY_AUTH_MODE"

_PUT_TOKEN = (
    "put the cluster's token (`ray get-auth-token` on the head prints it) in RAY_AUTH_TOKEN or "
    "~/.ray/auth_token here"
)
AUTH_HINT = f"the cluster requires token authentication and refused this client: {_PUT_TOKEN}"


class RayAuthRefused(ConnectionError):
    """A Ray cluster refused this driver for want of the right token; the message says what to do."""


def token_source(env: Mapping[str, str] | None = None, home: Path | None = None) -> str | None:
    """Where Ray would take a token from in this process (`env`, default: os.environ): the variable or
    the file; None when there is none."""
    env = os.environ if env is None else env
    if env.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = env.get("RAY_AUTH_TOKEN_PATH")
    token_file = Path(path).expanduser() if path else (home or Path.home()) / ".ray" / "auth_token"
    return str(token_file) if token_file.is_file() else None


def use_token_at_hand() -> bool:
    """With RAY_AUTH_MODE unset and a token at hand, set RAY_AUTH_MODE=token; whether it was set."""
    if AUTH_MODE in os.environ or token_source() is None:
        return False
    os.environ[AUTH_MODE] = "token"
    return True


def wants_token(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get(AUTH_MODE, "").lower() == "token"


def ray_follows_auth_mode() -> bool:
    """Make Ray in this process use the authentication mode RAY_AUTH_MODE says now; whether it does.

    Ray reads the variable at import; imported before (a notebook's `import ray` in an earlier cell), its
    configuration is read again, which is what `ray.init` does when it turns token authentication on for
    a local instance, and its cached token is dropped. False where this Ray has no such configuration to
    reread (then only setting the variable before importing Ray, or a new process, helps)."""
    if "ray" not in sys.modules:
        return True  # read when it is imported
    try:
        from ray import _raylet
    except ImportError:
        return False
    names = ("AuthenticationMode", "AuthenticationTokenLoader", "Config", "get_authentication_mode")
    if not all(hasattr(_raylet, name) for name in names):  # a Ray without token authentication
        return not wants_token()
    raylet: Any = _raylet

    def follows() -> bool:
        return bool(raylet.get_authentication_mode() == raylet.AuthenticationMode.TOKEN) == wants_token()

    if follows():
        return True
    raylet.Config.initialize("")
    raylet.AuthenticationTokenLoader.instance().reset_cache()
    return follows()


def auth_refused(error: BaseException) -> bool:
    """Whether Ray refused to let this process join a cluster for want of the right token (the reason is
    in the chain of causes, in Ray's own words)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if (
            isinstance(current, RayAuthRefused)
            or type(current).__name__ == "AuthenticationError"
            or "InvalidAuthToken" in str(current)
        ):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def refusal(address: str, *, ray_follows: bool, env: Mapping[str, str] | None = None) -> str:
    """One line on why the cluster at `address` refused this driver and what to do about it.
    `ray_follows`: whether Ray here uses the mode RAY_AUTH_MODE says (`ray_follows_auth_mode`)."""
    said = f"the Ray cluster at {address} requires token authentication and refused this client"
    return f"{said}: {advice(ray_follows=ray_follows, env=env)}"


def advice(*, ray_follows: bool, env: Mapping[str, str] | None = None) -> str:
    """What to do so that a cluster with token authentication lets this driver in."""
    env = os.environ if env is None else env
    mode = env.get(AUTH_MODE)
    if mode is not None and not wants_token(env):
        return (
            f"RAY_AUTH_MODE={mode} here; set RAY_AUTH_MODE=token (or unset it) with the cluster's token in "
            "RAY_AUTH_TOKEN or ~/.ray/auth_token"
        )
    if not ray_follows:
        return (
            "Ray was imported in this process before RAY_AUTH_MODE=token was set and reads it only at "
            "import; set it before importing ray or d9d.cluster (`export RAY_AUTH_MODE=token`, or "
            "`%env RAY_AUTH_MODE=token` in a notebook's first cell), or restart the kernel"
        )
    source = token_source(env)
    if source is None:
        return f"no token here; {_PUT_TOKEN}"
    return (
        f"the token in {source} is not the cluster's (`ray get-auth-token` on the head prints it; put it "
        "there or in RAY_AUTH_TOKEN)"
    )
