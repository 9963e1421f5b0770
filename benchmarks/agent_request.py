"""The request of `benchmarks.overhead`: a realistic 20-message agent history as bytes.

Outside the data path: system prompt, user/assistant turns, four tool calls and their results,
tool schemas (about 8 KB of JSON), shaped like a τ-bench airline session. Its last message
carries a per-request counter (`Bodies.next`), as a live agent's history grows by one message
a turn, so no request is a byte-for-byte repeat of the one before. The same history is also
written as a `/v1/responses` body (`Bodies("responses")`) and a `/v1/messages` one
(`Bodies("messages")`).
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks import messages_shape, responses_shape

APIS = ("chat", "responses", "messages")
MODES = ("json", "stream")
NONCE = "@@NONCE@@"


def _call(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
        ],
    }


def _result(call_id: str, value: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(value)}


def _tool(name: str, description: str, **props: str) -> dict[str, Any]:
    properties = {p: {"type": "string", "description": d} for p, d in props.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(props)},
        },
    }


def chat_history() -> list[dict[str, Any]]:
    """20 messages shaped like a tau-bench airline session (the last one holds the nonce)."""
    policy = (
        "# Airline Agent Policy\n\nThe current time is 2024-05-15 15:00:00 EST.\n\n"
        "As an airline agent, you can help users book, modify, or cancel flight reservations.\n"
        "- Before taking any actions that update the booking database, you must list the "
        "action details and obtain explicit user confirmation (yes) to proceed.\n"
        "- You should only make one tool call at a time.\n"
        "- You should deny user requests that are against this policy.\n\n"
        "## Modify flight\n- The agent must first obtain the user id and the reservation id.\n"
        "- Basic economy flights cannot be modified. Other reservations can be modified "
        "without changing the origin, destination, and trip type.\n"
        "- The user may change cabin class; all flights in the reservation must share it.\n"
        "- Payment: the user must provide a single gift card or credit card for any fee.\n"
    ) * 3
    flight = {
        "flight_number": "HAT136",
        "origin": "JFK",
        "destination": "SEA",
        "scheduled_departure_time_est": "19:00:00",
        "status": "available",
        "available_seats": {"basic_economy": 9, "economy": 14, "business": 3},
        "prices": {"basic_economy": 87, "economy": 167, "business": 442},
    }
    user = {
        "user_id": "mia_li_3668",
        "name": {"first_name": "Mia", "last_name": "Li"},
        "address": {"address1": "975 Sunset Drive", "city": "Austin", "zip": "78750"},
        "email": "mia.li3818@example.com",
        "dob": "1990-04-05",
        "membership": "gold",
        "payment_methods": {
            "credit_card_4421486": {"source": "credit_card", "brand": "visa", "last_four": "7447"},
            "certificate_7504069": {"source": "certificate", "amount": 250},
        },
        "reservations": ["NO6JO3", "AIXC49", "HKEG34"],
    }
    reservation = {
        "reservation_id": "NO6JO3",
        "user_id": "mia_li_3668",
        "origin": "JFK",
        "destination": "SEA",
        "flight_type": "one_way",
        "cabin": "economy",
        "flights": [{"flight_number": "HAT100", "date": "2024-05-20", "price": 151}],
        "passengers": [{"first_name": "Mia", "last_name": "Li", "dob": "1990-04-05"}],
        "payment_history": [{"payment_id": "credit_card_4421486", "amount": 151}],
        "created_at": "2024-05-02T10:11:12",
        "total_baggages": 1,
        "nonfree_baggages": 0,
        "insurance": "no",
    }
    return [
        {"role": "system", "content": policy},
        {"role": "user", "content": "Hi! I need to move my flight to Seattle to another day."},
        {"role": "assistant", "content": "Sure. Could you give me your user id, please?"},
        {"role": "user", "content": "It's mia_li_3668."},
        _call("call_1", "get_user_details", {"user_id": "mia_li_3668"}),
        _result("call_1", user),
        {
            "role": "assistant",
            "content": "Thanks, Mia. Which reservation: NO6JO3, AIXC49 or HKEG34?",
        },
        {"role": "user", "content": "The JFK to Seattle one, I think NO6JO3."},
        _call("call_2", "get_reservation_details", {"reservation_id": "NO6JO3"}),
        _result("call_2", reservation),
        {
            "role": "assistant",
            "content": "NO6JO3 is a one-way economy trip JFK to SEA on "
            "2024-05-20 on HAT100. Which date would you like?",
        },
        {"role": "user", "content": "The 22nd, the evening if possible."},
        _call(
            "call_3",
            "search_direct_flight",
            {"origin": "JFK", "destination": "SEA", "date": "2024-05-22"},
        ),
        _result(
            "call_3",
            [
                flight,
                {**flight, "flight_number": "HAT039", "scheduled_departure_time_est": "22:00:00"},
            ],
        ),
        {
            "role": "assistant",
            "content": "Two direct evening flights on 2024-05-22: HAT136 at "
            "19:00 (economy $167) and HAT039 at 22:00 (economy "
            "$167). The fare difference is $16. Which one?",
        },
        {"role": "user", "content": "HAT136, economy, pay with the visa card."},
        {
            "role": "assistant",
            "content": "To confirm: NO6JO3 moves to HAT136 on 2024-05-22, "
            "economy, the $16 difference charged to visa 7447. "
            "Shall I proceed (yes/no)?",
        },
        {"role": "user", "content": "yes"},
        _call(
            "call_4",
            "update_reservation_flights",
            {
                "reservation_id": "NO6JO3",
                "cabin": "economy",
                "payment_id": "credit_card_4421486",
                "flights": [{"flight_number": "HAT136", "date": "2024-05-22"}],
            },
        ),
        _result(
            "call_4",
            {
                **reservation,
                "flights": [{"flight_number": "HAT136", "date": "2024-05-22", "price": 167}],
                "request": NONCE,
            },
        ),
    ]


def chat_tools() -> list[dict[str, Any]]:
    return [
        _tool("get_user_details", "Get the details of a user.", user_id="The user id."),
        _tool("get_reservation_details", "Get a reservation.", reservation_id="The id."),
        _tool(
            "search_direct_flight",
            "Search direct flights.",
            origin="IATA code",
            destination="IATA code",
            date="YYYY-MM-DD",
        ),
        _tool(
            "update_reservation_flights",
            "Change the flights of a reservation.",
            reservation_id="The id.",
            cabin="The cabin.",
            payment_id="The payment id.",
        ),
    ]


def body_template(stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": "gpt-4o",
        "messages": chat_history(),
        "tools": chat_tools(),
        "temperature": 0.0,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def responses_template(stream: bool) -> bytes:
    """The same history as a `/v1/responses` body (`benchmarks.responses_shape`): the system
    prompt as `instructions`, the turns as message items, the calls and results as
    `function_call` / `function_call_output` items, the tools in Responses form; `store`
    false, as a client that sends its whole history each turn (Codex) does."""
    body = responses_shape.request_body(
        "gpt-4o",
        chat_history(),
        tools=responses_shape.tools(chat_tools()),
        temperature=0.0,
        store=False,
    )
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def messages_template(stream: bool) -> bytes:
    """The same history as a `/v1/messages` body (`benchmarks.messages_shape`), with the
    cache breakpoints Claude Code sets: the system prompt, and the last block."""
    body = messages_shape.request_body(
        "claude-x", chat_history(), tools=messages_shape.tools(chat_tools()), temperature=0.0
    )
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


TEMPLATES = {"chat": body_template, "responses": responses_template, "messages": messages_template}


class Bodies:
    """Request bodies of one API ("chat", "responses" or "messages"), each with its own
    counter in the last message."""

    def __init__(self, api: str = "chat") -> None:
        self.api = api
        template = TEMPLATES[api]
        self.templates = {mode: template(mode == "stream") for mode in MODES}
        self.n = 0

    def next(self, mode: str) -> bytes:
        self.n += 1
        return self.templates[mode].replace(NONCE.encode(), str(self.n).encode())
