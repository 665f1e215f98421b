"""`python -m launcher rollout` / `rollback` (`make rollout`, `make rollback`): ask the running frontend's
admin API (frontend/http/admin.py) to make a version of a named model live, and print the version now live.

The launcher does not roll anything out itself: the frontend that serves the model does, so that requests on
the old version drain first. The request carries the admin key (ADMIN_API_KEYS, ADMIN_API_KEYS_FILE, else the
one `make serve` made in the work dir: launcher/keys.py).
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.parse
import urllib.request

from launcher.config import Config
from launcher.keys import first_key
from launcher.loopback import loopback_tls

ADMIN_TIMEOUT_S = 1800.0  # a rollout loads a version and waits for the old one to drain (ROLLOUT_GRACE_S)


def administer(cfg: Config, name: str, action: str, version: int | None) -> int:
    """`make rollout` / `make rollback`: ask the running frontend, print the version now live."""
    url = f"{cfg.frontend_base}/admin/models/{urllib.parse.quote(name, safe='')}/{action}"
    body = json.dumps({"version": version} if version is not None else {}).encode()
    headers = {"Content-Type": "application/json"}
    key = first_key("ADMIN_API_KEYS", "ADMIN_API_KEYS_FILE", cfg.admin_key_file)
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    context = loopback_tls() if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(request, timeout=ADMIN_TIMEOUT_S, context=context) as response:
            result = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        print(f"error: {action} of {name} refused ({exc.code}): {message}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"error: no server answers at {cfg.frontend_base} ({exc}); is `make serve` running with the same "
              "FRONTEND_PORT?", file=sys.stderr)
        return 1
    if not result["changed"]:
        print(f"{name}: version {result['live_version']} is live (it already was)")
        return 0
    if result["previous_version"] is None:
        print(f"{name}: version {result['live_version']} is live (a model new to this server)")
        return 0
    drained = ("requests on it finished" if result["drained"] else
               "requests still on it after ROLLOUT_GRACE_S were ended")
    print(f"{name}: version {result['live_version']} is live; version {result['previous_version']} unloaded "
          f"({drained}; {result['seconds']:.1f} s)")
    return 0
