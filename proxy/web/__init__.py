"""The operator web page at `/recap/`: server-rendered HTML over the operator routes' code.

Off the data path. `web_routes(config)` is called by `create_app`, so each app has
its own session secret. Modules, from the request inwards:

    routes        HTTP: read the credential, query and form; call the operator code
    auth          operator keys, the signed session cookie, CSRF and Origin checks
    timeline      one pass over a conversation's events: requests, rollbacks, a chosen one
    layout        the page shell (inline CSS, no script), login and error pages, URLs
    listing       the front page: conversations per tenant
    conversation  the conversation page, drawing on chart, diff and messages
    holdout       the holdout report page, a chart per measure
    markup        escaped HTML: every value passes through html.escape
"""

from __future__ import annotations

from starlette.routing import Route

from proxy.config import Config
from proxy.web.auth import Sessions
from proxy.web.routes import web_routes as _routes


def web_routes(config: Config) -> list[Route]:
    return _routes(Sessions(config))
