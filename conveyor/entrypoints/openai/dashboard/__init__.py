"""`/dashboard`: the scheduler, live in the browser.

  GET /dashboard          the page (one self-contained file: no data in it, no CDN)
  GET /dashboard/events   server-sent events: the state and the new step records, every TICK
  GET /dashboard/state    the same as one JSON document, with the last minute's records and
                          a snapshot taken for it

The data routes sit behind the API key like the API. A browser cannot put a header on a page
it is sent to, so the page itself is open; it takes the key from the address's fragment
(`/dashboard#key=...`, which never reaches the server) or asks for it, and sends it with its
own requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from conveyor.entrypoints.openai.dashboard.feed import TICK, DashboardFeed

__all__ = ["DashboardFeed", "add_dashboard_routes"]

MAX_WATCHERS = 32  # open event streams; one more gets a 429


def add_dashboard_routes(app: FastAPI, feed: DashboardFeed) -> None:
    page = resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/state")
    async def state() -> dict:
        records, cursor = feed.records_since(None)
        return (await feed.state(fresh=True)) | {"records": records, "cursor": cursor}

    @app.get("/dashboard/events")
    async def events():
        if feed.num_watchers >= MAX_WATCHERS:
            body = {
                "error": {
                    "message": f"at most {MAX_WATCHERS} dashboards may watch at once",
                    "type": "RateLimitError",
                    "param": None,
                    "code": None,
                }
            }
            return JSONResponse(body, status_code=429)
        return StreamingResponse(
            _stream(feed),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )


async def _stream(feed: DashboardFeed):
    feed.num_watchers += 1
    cursor = None
    try:
        while not feed.closed:  # a client that goes away cancels this generator
            start = time.monotonic()
            state = await feed.state()
            records, cursor = feed.records_since(cursor)
            payload = json.dumps(state | {"records": records, "cursor": cursor})
            yield f"data: {payload}\n\n"
            await asyncio.sleep(max(TICK - (time.monotonic() - start), 0.05))
    finally:
        feed.num_watchers -= 1
