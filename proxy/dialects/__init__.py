"""One adapter per API at the edge: a body <-> the neutral history the planners see.

The seam, in four verbs (`Dialect` in proxy/dialects/base.py):

    parse(raw)              -> Parsed(body, messages, ...) or Unparsed(reason, detail)
    render(parsed, view)    -> the body to forward, with `view` in place of the history
    recorder(streamed, ...) -> reads the answer (archive, usage for calibration)
    error_event(body, st)   -> an upstream error as one in-band SSE event of this API
    errors                  -> Recap's own errors in this API's shape (body, stream event)

The neutral view is the list of chat-shaped messages the planners have always read
(`proxy.history.messages`, `proxy.history.conversation`): pinned system/developer messages, user and
assistant messages with text and attachment parts, assistant messages whose
`tool_calls` carry ids, and `tool` results naming the call they answer. Planners keep
the messages they do not change as the very same objects and make new dicts for the
ones they rewrite (placeholders, summaries), so an adapter renders an unchanged
message from what it parsed it from, byte for byte at the JSON level, and only a new
or rewritten one from its neutral fields.

Chat Completions (`chat.py`) is the identity adapter: its messages are the view. The
Responses API (`responses.py`) groups its items into neutral messages: a `reasoning`
item, a built-in tool call or any item of a type Recap does not know is carried
verbatim inside the neutral message of the item that follows it, so it is never cut
from that item and is dropped only where its whole message is summarised. An adapter
for the Anthropic Messages API maps content blocks the same way (thinking blocks like
reasoning, tool_use/tool_result like calls and results).

Pure: no IO here (tests/test_layers.py); the route (proxy/edge/compacting.py) reads the
bytes, runs the pipeline and relays the stream.
"""
