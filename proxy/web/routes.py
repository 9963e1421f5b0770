"""The operator web page's routes under `/recap/`: HTTP in, escaped HTML out.

Off the data path, beside the JSON operator routes (`proxy.edge.operator`), whose rules
and code it reuses: `resolve_caller` decides what a key may see, `inspection`
reads, `manual_compaction` and `inspection.rollback` act. This module only reads
the request (credential, query, form), calls them, and renders `RecapError`s as
an HTML page with their status.

    GET  /recap/                      conversations per tenant (?tenant=, ?before=)
    GET  /recap/login, POST           the login form (one field, `key`)
    POST /recap/logout
    GET  /recap/conversation          ?tenant=&key= (&request=EVENT_ID &from=V &to=W)
    GET  /recap/report                ?tenant=&since= (the holdout report)
    POST /recap/compact               form: tenant, key, csrf
    POST /recap/rollback              form: tenant, key, version ("" for none), csrf
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from proxy.archive.holdout import DEFAULT_SINCE, holdout_report, parse_since
from proxy.archive.inspection import detail, list_page, parse_version, rollback
from proxy.edge.operator import Caller, manual_compaction, resolve_caller
from proxy.errors import BadRequest, Conflict, NotFound, RecapError, Unauthorized
from proxy.record import RequestRecord, record_of
from proxy.state import AppState
from proxy.store.base import ConversationRef, StoreError
from proxy.web.auth import (
    COOKIE,
    Credential,
    Sessions,
    check_same_origin,
    cookie_attributes,
    presented,
)
from proxy.web.conversation import ConversationView, conversation_page
from proxy.web.holdout import report_page
from proxy.web.layout import conversation_url, error_page, login_page, url
from proxy.web.listing import list_page as render_list
from proxy.web.timeline import ChosenRequest, read_timeline, resolve

MAX_FORM = 16 * 1024
PAGE_SIZE = 50
NOTICES = {
    "compacted": "Compacted now: the new summary version is current.",
    "rolled-back": "Rolled back: the chosen version is current; later ones are kept but unused.",
}
SECURITY_HEADERS = {
    # No script at all, styles inline only, forms only to this server, never framed.
    "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'"
    " data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    # Not no-referrer: with it browsers send `Origin: null` on a same-origin form post.
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


class StorePageUnavailable(RecapError):
    status = 503
    type = "server_error"
    code = "store_unavailable"


@dataclass
class Visit:
    """One request to the page: the app, who it is, and its record (the access line)."""

    request: Request
    state: AppState
    sessions: Sessions
    credential: Credential | None
    record: RequestRecord

    @property
    def csrf(self) -> str:
        return self.sessions.csrf(self.credential)

    def caller(self, named: str | None, *, need_tenant: bool) -> Caller:
        """The JSON routes' rule, over the key this visit presented (or none)."""
        headers = self.credential.headers() if self.credential else {}
        caller = resolve_caller(self.state.config, headers, named, need_tenant=need_tenant)
        if caller.tenant is not None:
            self.record.tenant = caller.tenant.name
        return caller

    def who(self, caller: Caller) -> str:
        if caller.admin:
            return "admin"
        assert caller.tenant is not None  # only an admin may see all tenants
        return f"tenant {caller.tenant.name}" + (" (open)" if self.credential is None else "")

    async def form(self, *, csrf: bool = True) -> dict[str, str]:
        """A urlencoded form (the only kind the page sends), after the cross-site checks.

        The login form carries no token (there is no session yet, or it replaces one)."""
        check_same_origin({k.lower(): v for k, v in self.request.headers.items()})
        raw = await self.request.body()
        if len(raw) > MAX_FORM:
            raise BadRequest("form is too large")
        parsed = parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True)
        form = {k: v[0] for k, v in parsed.items()}
        if csrf:
            self.sessions.check_csrf(self.credential, form.get("csrf", ""))
        return form


Handler = Callable[[Visit], Awaitable[Response]]


def _html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)


def _redirect(location: str) -> Response:
    return RedirectResponse(location, status_code=303, headers=SECURITY_HEADERS)


def _endpoint(sessions: Sessions, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        visit = Visit(
            request,
            request.state.recap,
            sessions,
            presented(sessions, request.headers, request.cookies.get(COOKIE)),
            record_of(request.scope),
        )
        error: RecapError
        await visit.state.archiver.flush()  # every answered request is shown
        try:
            return await handler(visit)
        except Unauthorized as err:
            if visit.credential is None and request.method == "GET":
                return _redirect(url("/login"))
            error = err
        except RecapError as err:
            error = err
        except StoreError as exc:
            error = StorePageUnavailable(f"The store is unavailable: {exc}")
        visit.record.error = error.code
        if isinstance(error, Unauthorized):
            response = _html(login_page(error.message), error.status)
            response.delete_cookie(COOKIE, path="/recap")
            return response
        back = request.headers.get("referer") or url("/")
        page = error_page(error.status, error.message, who=None, csrf=visit.csrf, back=back)
        return _html(page, error.status)

    return endpoint


async def _home(visit: Visit) -> Response:
    params = visit.request.query_params
    caller = visit.caller(params.get("tenant") or None, need_tenant=False)
    try:
        before = float(params["before"]) if params.get("before") else None
    except ValueError:
        raise BadRequest("before must be a number (the page's last update time)") from None
    shown = caller.tenant.name if caller.tenant else None
    listing = await list_page(visit.state.store, shown, PAGE_SIZE, before)
    tenants = list(visit.state.config.tenants) if caller.admin else [shown or ""]
    config = visit.state.config
    held = [t for t in tenants if t in config.tenants and config.tenants[t].holdout > 0]
    body = render_list(
        listing,
        tenants=tenants,
        shown=shown,
        who=visit.who(caller),
        csrf=visit.csrf,
        holdouts=held,
    )
    return _html(body)


async def _login_form(visit: Visit) -> Response:
    return _html(login_page())


async def _login(visit: Visit) -> Response:
    form = await visit.form(csrf=False)
    key = form.get("key", "").strip()
    if not key or not visit.sessions.known(key):
        visit.record.error = "invalid_api_key"
        return _html(login_page("That is not an operator key of this proxy."), 401)
    response = _redirect(url("/"))
    secure = visit.request.url.scheme == "https" or (
        visit.request.headers.get("x-forwarded-proto") == "https"
    )
    attributes = cookie_attributes(secure, int(visit.sessions.ttl_s))
    response.set_cookie(COOKIE, visit.sessions.issue(key), **attributes)  # type: ignore[arg-type]
    return response


async def _logout(visit: Visit) -> Response:
    await visit.form()
    if visit.credential is not None:
        # The session itself ends, not only the browser's copy of its cookie.
        visit.sessions.revoke(visit.credential)
    response = _redirect(url("/login"))
    response.delete_cookie(COOKIE, path="/recap")
    return response


def _int_param(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequest(f"{name} must be an integer", name) from None


def _conversation(
    visit: Visit, tenant: str | None, key: str | None
) -> tuple[Caller, ConversationRef]:
    if not key:
        raise BadRequest("Which conversation? (key is missing)", "key")
    caller = visit.caller(tenant or None, need_tenant=True)
    assert caller.tenant is not None  # need_tenant
    visit.record.conversation = key
    return caller, ConversationRef(caller.tenant.name, key)


async def _show(visit: Visit) -> Response:
    params = visit.request.query_params
    caller, conv = _conversation(visit, params.get("tenant"), params.get("key"))
    wanted = _int_param(params.get("request"), "request")
    old, new = _int_param(params.get("from"), "from"), _int_param(params.get("to"), "to")
    store = visit.state.store
    info = await detail(store, conv)
    timeline = await read_timeline(store, conv, wanted)
    chosen: ChosenRequest | None = None
    chosen_error: str | None = None
    if timeline.chosen is not None:
        try:
            chosen = await resolve(store, conv, timeline.chosen)
        except Conflict as err:
            chosen_error = err.message
    elif wanted is not None:
        chosen_error = f"No request {wanted} in this conversation."
    view = ConversationView(
        tenant=conv.tenant,
        key=conv.key,
        detail=info,
        timeline=timeline,
        chosen=chosen,
        chosen_error=chosen_error,
        diff=(old, new) if old is not None and new is not None else None,
        notice=NOTICES.get(params.get("notice") or ""),
    )
    return _html(conversation_page(view, who=visit.who(caller), csrf=visit.csrf))


async def _report(visit: Visit) -> Response:
    params = visit.request.query_params
    caller = visit.caller(params.get("tenant") or None, need_tenant=True)
    assert caller.tenant is not None  # need_tenant
    since = params.get("since") or DEFAULT_SINCE
    now = time.time()
    report = await holdout_report(
        visit.state.store,
        caller.tenant.name,
        since=parse_since(since, now),
        until=now,
        prices=caller.tenant.prices,
        holdout=caller.tenant.holdout,
    )
    return _html(report_page(report, since, who=visit.who(caller), csrf=visit.csrf))


async def _compact(visit: Visit) -> Response:
    form = await visit.form()
    caller, conv = _conversation(visit, form.get("tenant"), form.get("key"))
    assert caller.tenant is not None
    await manual_compaction(visit.state, caller, caller.tenant, conv, visit.record)
    return _redirect(conversation_url(conv.tenant, conv.key, notice="compacted"))


async def _rollback(visit: Visit) -> Response:
    form = await visit.form()
    _, conv = _conversation(visit, form.get("tenant"), form.get("key"))
    version = parse_version({"version": _int_param(form.get("version"), "version")})
    request_id = visit.record.request_id
    await rollback(visit.state.store, conv, version, request_id)
    return _redirect(conversation_url(conv.tenant, conv.key, notice="rolled-back"))


async def _unknown(visit: Visit) -> Response:
    raise NotFound(f"No page {visit.request.url.path}.")


async def _slash(request: Request) -> Response:
    return _redirect(url("/"))


def web_routes(sessions: Sessions) -> list[Route]:
    """The page's routes; `sessions` holds the per-app secret (made in `create_app`)."""

    def route(path: str, handler: Handler, method: str) -> Route:
        return Route(url(path), _endpoint(sessions, handler), methods=[method])

    return [
        Route("/recap", _slash, methods=["GET"]),
        route("/", _home, "GET"),
        route("/login", _login_form, "GET"),
        route("/login", _login, "POST"),
        route("/logout", _logout, "POST"),
        route("/conversation", _show, "GET"),
        route("/report", _report, "GET"),
        route("/compact", _compact, "POST"),
        route("/rollback", _rollback, "POST"),
        Route("/recap/{path:path}", _endpoint(sessions, _unknown)),
    ]
