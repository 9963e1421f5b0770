"""The page shell every web page shares: inline CSS, the header, the login and error pages.

Pure rendering, off the data path: no script, no remote asset (the page works
offline and under a `default-src 'none'` content security policy). URLs are
built here so that every link encodes its query the same way.
"""

from __future__ import annotations

from urllib.parse import urlencode

from proxy.web.markup import Html, render

BASE = "/recap"

CSS = """
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans","Noto Sans CJK SC",
sans-serif;margin:0;color:#1f2328;background:#f6f8fa}
header{background:#24292f;color:#fff;padding:10px 24px;display:flex;gap:16px;align-items:center}
header a{color:#fff;text-decoration:none;font-weight:600}
header .who{margin-left:auto;opacity:.85}
header form{margin:0}
main{max-width:1200px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:20px;margin:8px 0 12px;word-break:break-all}
h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
table{border-collapse:collapse;width:100%;background:#fff;border:1px solid #d0d7de}
th,td{padding:5px 8px;border-bottom:1px solid #eaeef2;text-align:left;vertical-align:top}
th{background:#f6f8fa;font-weight:600;white-space:nowrap}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.key{word-break:break-all;width:36%}
a{color:#0969da}
.muted{color:#656d76}
.notice{background:#dafbe1;border:1px solid #4ac26b;padding:8px 12px;border-radius:6px}
.error{background:#ffebe9;border:1px solid #ff8182;padding:8px 12px;border-radius:6px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:8px 0}
.card{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:8px 14px;min-width:130px}
.card b{display:block;font-size:18px}
.actions{display:flex;gap:16px;flex-wrap:wrap;align-items:center;margin:12px 0}
.actions form{display:flex;gap:6px;align-items:center;margin:0}
button{font:inherit;padding:4px 12px;border:1px solid #d0d7de;border-radius:6px;background:#fff;
cursor:pointer}
button.primary{background:#1f883d;color:#fff;border-color:#1f883d}
button.danger{color:#cf222e}
input,select{font:inherit;padding:4px 6px;border:1px solid #d0d7de;border-radius:6px}
pre{white-space:pre-wrap;word-break:break-word;margin:0;font:12.5px/1.4 ui-monospace,
SFMono-Regular,Menlo,Consolas,monospace}
.summary{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:10px 12px;
max-height:22em;overflow:auto}
.chart{background:#fff;border:1px solid #d0d7de;border-radius:6px;width:100%;height:auto}
.chart .grid{stroke:#eaeef2}
.chart .axis{font-size:11px;fill:#656d76}
.chart .hit{fill:transparent}
.chart a:hover .hit{fill:#0969da14}
.legend{margin:4px 0}
.measures{display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));gap:10px;
margin:12px 0}
figure.measure{margin:0;background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:8px}
figure.measure .chart{border:none}
figure.measure p{margin:2px 0 0}
.legend span{margin-right:16px}
.diff{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:8px;max-height:30em;
overflow:auto}
.diff .add{background:#dafbe1;display:block}
.diff .del{background:#ffebe9;display:block}
.diff .hunk{color:#8250df;display:block}
.sides{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.sides>div{max-height:48em;overflow:auto;padding-right:4px}
.sides h3{position:sticky;top:0;background:#f6f8fa;margin:0;padding:4px 0}
.msg{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:6px 10px;margin:6px 0}
.msg .role{font-weight:600;font-size:12px;text-transform:uppercase;color:#656d76}
.msg .role .muted{text-transform:none;font-weight:400}
.msg.synthetic{border-color:#8250df;background:#fbefff}
.msg.folded{opacity:.55}
.tag{font-size:11px;border-radius:10px;padding:0 6px;margin-left:6px;border:1px solid}
.tag.synthetic{color:#8250df}
.tag.folded{color:#656d76}
tr.ok td.outcome{color:#1a7f37}
tr.failed td.outcome{color:#cf222e}
tr.dropped td.outcome{color:#cf222e}
.tag.dropped{color:#cf222e}
tr.rollback{background:#fff8c5}
tr.rolled-back td{color:#656d76}
tr.chosen{background:#ddf4ff}
.login{max-width:380px;margin:80px auto;background:#fff;border:1px solid #d0d7de;
border-radius:6px;padding:20px 24px}
.login input{width:100%;margin:8px 0 12px}
nav.tenants a{margin-right:12px}
nav.tenants a.on{font-weight:700;text-decoration:none;color:#1f2328}
"""


def url(path: str, /, **query: object) -> str:
    """A path under /recap/ with its query (None values left out)."""
    params = {k: str(v) for k, v in query.items() if v is not None}
    return BASE + path + ("?" + urlencode(params) if params else "")


def conversation_url(tenant: str, key: str, **query: object) -> str:
    return url("/conversation", tenant=tenant, key=key, **query)


def page(title: str, body: Html, *, who: str | None = None, csrf: str = "") -> Html:
    """A whole document. `who` names the signed-in operator (None on the login page)."""
    logout = (
        render(
            '<form method="post" action="{action}"><input type="hidden" name="csrf"'
            ' value="{csrf}"><button type="submit">Log out</button></form>',
            action=url("/logout"),
            csrf=csrf,
        )
        if who is not None
        else Html("")
    )
    signed = render('<span class="who">{who}</span>', who=who) if who is not None else Html("")
    return render(
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>{title} · Recap</title><style>{css}</style></head><body>"
        '<header><a href="{home}">Recap</a><span>operator</span>{signed}{logout}</header>'
        "<main>{body}</main></body></html>",
        title=title,
        css=Html(CSS),
        home=url("/"),
        signed=signed,
        logout=logout,
        body=body,
    )


def login_page(message: str | None = None) -> Html:
    error = render('<p class="error">{m}</p>', m=message) if message else Html("")
    body = render(
        '<form class="login" method="post" action="{action}">'
        "<h1>Recap operator</h1>{error}"
        '<label for="key">Operator key</label>'
        '<input id="key" name="key" type="password" autocomplete="current-password"'
        " required autofocus>"
        '<button class="primary" type="submit">Log in</button>'
        '<p class="muted">An admin key (<code>admin_keys</code> in the config) sees every'
        " tenant; a tenant's proxy key (its <code>api_keys</code>) sees that tenant. With no"
        " <code>admin_keys</code> configured, <code>recap serve</code> makes an admin key on"
        " its first start and names the file that holds it in its start-up line.</p></form>",
        action=url("/login"),
        error=error,
    )
    return page("Log in", body)


def error_page(status: int, message: str, *, who: str | None, csrf: str, back: str) -> Html:
    body = render(
        '<h1>Error {status}</h1><p class="error">{message}</p><p><a href="{back}">Back</a></p>',
        status=status,
        message=message,
        back=back,
    )
    return page(f"Error {status}", body, who=who, csrf=csrf)
