"""Tests mirror the package: a reader finds a module's tests by its path.

`proxy/<folder>/<name>.py` is tested in `tests/<folder>/test_<name>.py` (mitmproxy's
`test/filename_matching.py` does the same). A module whose behaviour is tested only
through another's tests (most often end to end, through a real server) is listed
below with the test file that covers it, so the reader is sent there instead; that
file must exist, and a module that gains its own test file leaves the list.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import proxy

pytestmark = pytest.mark.quick

PACKAGE = Path(proxy.__file__).parent
TESTS = Path(__file__).parent

TESTED_ELSEWHERE = {
    "app.py": "tests/edge/test_compacting.py",
    "pipeline.py": "tests/stages/test_session.py",
    "state.py": "tests/edge/test_compacting.py",
    "archive/export.py": "tests/edge/test_operator.py",
    "archive/retention.py": "tests/store/test_store.py",
    "dialects/base.py": "tests/dialects/test_chat.py",
    "edge/front.py": "tests/edge/test_boundary.py",
    "edge/guards.py": "tests/edge/test_serving.py",
    "edge/answer.py": "tests/edge/test_compacting_stream.py",
    "edge/forward.py": "tests/edge/test_overflow.py",
    "edge/intake.py": "tests/edge/test_compacting.py",
    "edge/relay.py": "tests/system/test_faults_client.py",
    "history/conversation_ref.py": "tests/history/test_identity.py",
    "history/messages.py": "tests/history/test_conversation.py",
    "ops/ansi.py": "tests/ops/test_logs.py",
    "ops/tail.py": "tests/ops/test_logs.py",
    "ops/tail_fields.py": "tests/ops/test_logs.py",
    "stages/archive.py": "tests/archive/test_archive_fidelity.py",
    "stages/calibration.py": "tests/edge/test_overflow.py",
    "stages/estimate.py": "tests/stages/test_session.py",
    "stages/expansion.py": "tests/edge/test_codex_references.py",
    "stages/manual.py": "tests/edge/test_operator.py",
    "stages/remote.py": "tests/edge/test_codex.py",
    "stages/riding.py": "tests/stages/test_ahead_riding.py",
    "stages/trim.py": "tests/planning/test_trim.py",
    "store/base.py": "tests/store/test_store.py",
    "store/pg_boundary.py": "tests/store/test_postgres.py",
    "store/pg_lock.py": "tests/store/test_postgres.py",
    "store/rows.py": "tests/store/test_store.py",
    "store/sql.py": "tests/store/test_store.py",
    "store/sqlite.py": "tests/store/test_store.py",
    "store/transfer.py": "tests/store/test_migrate_store.py",
    "upstream/connection.py": "tests/upstream/test_transport.py",
    "upstream/error_answer.py": "tests/edge/test_overflow.py",
    "web/chart.py": "tests/web/test_render.py",
    "web/conversation.py": "tests/web/test_render.py",
    "web/diff.py": "tests/web/test_render.py",
    "web/holdout.py": "tests/system/test_holdout.py",
    "web/layout.py": "tests/web/test_routes.py",
    "web/listing.py": "tests/web/test_render.py",
    "web/markup.py": "tests/web/test_render.py",
    "web/messages.py": "tests/web/test_render.py",
    "web/timeline.py": "tests/web/test_render.py",
    "wire/encoding.py": "tests/edge/test_body.py",
    "wire/numbers.py": "tests/edge/test_body.py",
    "wire/sse.py": "tests/edge/test_compacting.py",
}


def mirror(module: Path) -> Path:
    rel = module.relative_to(PACKAGE)
    return TESTS.joinpath(*rel.parts[:-1], "test_" + rel.name)


def modules() -> list[Path]:
    return [
        p for p in sorted(PACKAGE.rglob("*.py")) if p.name not in ("__init__.py", "__main__.py")
    ]


def test_every_module_has_its_test_file_or_says_where_it_is_tested() -> None:
    missing = []
    for module in modules():
        rel = module.relative_to(PACKAGE).as_posix()
        if not mirror(module).exists() and rel not in TESTED_ELSEWHERE:
            missing.append(rel)
    assert missing == []


def test_the_list_sends_the_reader_to_files_that_exist() -> None:
    root = TESTS.parent
    assert [f for f in TESTED_ELSEWHERE.values() if not (root / f).is_file()] == []


def test_a_module_with_its_own_test_file_leaves_the_list() -> None:
    listed = [m for m in modules() if m.relative_to(PACKAGE).as_posix() in TESTED_ELSEWHERE]
    assert [str(mirror(m)) for m in listed if mirror(m).exists()] == []
    known = {m.relative_to(PACKAGE).as_posix() for m in modules()}
    assert sorted(set(TESTED_ELSEWHERE) - known) == []
