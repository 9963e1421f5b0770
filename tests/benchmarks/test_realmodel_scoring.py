"""The real-model evaluation's pure scoring (benchmarks/realmodel/scoring.py): no model needed."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.realmodel.scoring import (
    Decision,
    accuracy,
    constraint_kept,
    decision_status,
    language_of,
    score_decisions,
    statuses_in,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "realmodel-zh.json"

ZH_SUMMARY = """<summary>
## User Goal
用户王建国要求为订单 ORD-20260917-4471 退款，金额 1,280.00 元。
## Confirmed Facts
- 退货单 RMA-55820，顺丰运单 SF1428873301。
## Decisions Made
- 退款 1,280.00 元已批准。
- 45 元运费补偿被驳回。
- PLUS 会员暂不开通，2026-10-15 之后再决定。
## Important References
- services/billing/invoice.py v2.7.3
</summary>"""

EN_SUMMARY = """<summary>
## User Goal
The user Wang Jianguo wants a refund for order ORD-20260917-4471 of 1,280.00.
## Decisions Made
- The refund was approved. The user said 「换货申请先别提交」.
</summary>"""

REFUND = Decision("refund", ("退款", "refund"), "approved")
SHIPPING = Decision("shipping", ("运费补偿",), "rejected")
PLUS = Decision("plus", ("PLUS",), "deferred")


def test_language_of_a_chinese_summary_with_english_headings_and_identifiers() -> None:
    assert language_of(ZH_SUMMARY) == "zh"


def test_language_of_an_english_summary_quoting_chinese() -> None:
    assert language_of(EN_SUMMARY) == "en"


def test_language_of_nothing_but_identifiers() -> None:
    assert language_of("## User Goal\nORD-1234 v2.7.3 a/b.py") == "unknown"


def test_constraint_kept_verbatim_with_or_without_quotes() -> None:
    assert constraint_kept("换货申请先别提交", "用户要求：「换货申请先别提交」。")
    assert constraint_kept("换货申请先别提交", "用户说换货申请先别提交，等周五。")
    assert constraint_kept("migrations 目录里的文件先别动", "migrations  目录里的文件先别动")


def test_a_paraphrased_constraint_is_not_kept() -> None:
    assert not constraint_kept("换货申请先别提交", "用户要求暂不提交换货申请。")


def test_decision_status_of_each_kind() -> None:
    scores = score_decisions([REFUND, SHIPPING, PLUS], ZH_SUMMARY)
    assert [s.found for s in scores] == ["approved", "rejected", "deferred"]
    assert accuracy(scores) == 1.0


def test_a_negated_approval_is_a_rejection_not_an_approval() -> None:
    assert statuses_in("退款未批准") == {"rejected"}
    assert statuses_in("the refund was not approved") == {"rejected"}
    assert statuses_in("退款已批准") == {"approved"}


def test_decision_status_missing_none_and_conflicting() -> None:
    assert decision_status(PLUS, "## Decisions Made\n- 退款已批准") == "missing"
    assert decision_status(PLUS, "- PLUS 会员年费 198 元") == "none"
    contradictory = "- PLUS 会员已批准开通\n- PLUS 会员暂不开通"
    assert decision_status(PLUS, contradictory) == "conflicting"


def test_a_wrong_status_counts_against_accuracy() -> None:
    scores = score_decisions([SHIPPING], "- 45 元运费补偿已批准")
    assert [s.found for s in scores] == ["approved"]
    assert accuracy(scores) == 0.0
    assert accuracy([]) is None


def test_the_labelled_set_scores_its_own_settling_messages_right() -> None:
    """Each decision's settling message, read as a summary line, states its labelled status:
    the labels and the status words agree on the data the evaluation uses."""
    data = json.loads(DATA.read_text(encoding="utf-8"))
    for conv in data["conversations"]:
        assert conv["language"] == language_of(
            "\n".join(m["content"] for m in conv["messages"] if m["role"] == "user")
        )
        users = [m["content"] for m in conv["messages"] if m["role"] == "user"]
        assert any(conv["constraint"] in u for u in users)
        for d in conv["decisions"]:
            decision = Decision(d["id"], tuple(d["keys"]), d["status"])
            texts = [m["content"] for m in conv["messages"]]
            settled = next(t for t in texts if d["settled_by"] in t)
            sentence = next(s for s in re.split("[。，]", settled) if d["settled_by"] in s)
            assert statuses_in(sentence) == {d["status"]}, (d["id"], sentence)
            assert decision_status(decision, settled) != "missing"
