"""The neutral model of a conversation that every planner, stage and dialect reads. Pure.

    messages          typed chat-shaped messages, classification, pinned + body
    conversation      turns, tool rounds, cut points, validity of a history
    conversation_ref  which conversation a request belongs to (tenant, key)
    identity          the tenant by proxy key; the conversation key
    fingerprints      fingerprints and chain hashes, computed incrementally
    measure           a request's memo of fingerprints and token counts
    tokens            token estimates per message (tiktoken, cached encoders)
    textcount         bounded token counting of one text
    attachments       what an image, audio or file part costs
    recent            a map bounded by idle time and total weight

May import: `proxy.config`, `proxy.errors`, `proxy.wire` (tests/test_layers.py).
"""
