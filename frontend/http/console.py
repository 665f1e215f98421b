"""The browser console (issue 53): GET / (the chat playground and live charts, static files shipped in the
package: frontend/static/console/), its files under /console/static/, and GET /console/summary.json (the charts'
data: frontend/observability/console.py). Off with CONSOLE=false (nothing of it is routed then).

The page holds no secret: it is served without a key, asks the user for one when the API wants it (kept in the
tab's sessionStorage) and sends it as `Authorization: Bearer` to this same origin. Its Content-Security-Policy
allows scripts, styles and requests from this origin only, no inline script, no frames.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from frontend.observability.console import live_summary
from frontend.observability.metrics import exposition

STATIC_DIR = Path(__file__).resolve().parents[1] / "static" / "console"
STATIC_PREFIX = "/console/static"
SUMMARY_PATH = "/console/summary.json"
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data:; font-src 'self'; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}

router = APIRouter()


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get(SUMMARY_PATH, include_in_schema=False)
async def summary(request: Request) -> dict[str, Any]:
    edge = request.app.state.edge
    return await live_summary(request.app.state.console, lambda: _exposition(edge))


async def _exposition(edge: Any) -> bytes:
    return await exposition(edge.metrics, edge.triton_metrics, await edge.limits.occupancy())


class ConsoleFiles(StaticFiles):
    """The page's scripts and styles, with the page's headers (nosniff above all)."""

    async def get_response(self, path: str, scope: Any) -> Any:
        response = await super().get_response(path, scope)
        response.headers.update(PAGE_HEADERS)
        return response


def static_files() -> ConsoleFiles:
    return ConsoleFiles(directory=STATIC_DIR)
