"""Byte formats on the wire, below any notion of a conversation. Pure: no IO.

    longjson   json.dumps / json.loads for very long strings, in slices
    numbers    JSON numbers exactly as the client wrote them
    members    a JSON object's top-level members where they sit in its text
    encoding   bounded Content-Encoding decoding (gzip, deflate, br)
    sse        reading a streamed (or JSON) answer as it passes, to archive it

May import: nothing of Recap's but `proxy.wire` itself (tests/test_layers.py).
"""
