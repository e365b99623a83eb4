import pytest

from ft_assets.data.cleaning import CleaningRules, clean_messages, clean_text
from ft_assets.data.rows import RowError

TEXT_CASES = [
    ("crlf", "a\r\nb\rc", "a\nb\nc"),
    ("controls", "a\x00b\x07c\x1bd\x7fe\x85f", "abcdef"),
    ("tabs-newlines-kept", "def f():\n\treturn 1", "def f():\n\treturn 1"),
    ("zero-width", "a\u200bb\ufeffc", "abc"),
    ("exotic-spaces", "a\u00a0b\u2009c\u3000d", "a b c d"),
    ("trailing-spaces", "a  \nb\t\n", "a\nb"),
    ("blank-runs", "a\n\n\n\n\nb", "a\n\nb"),
    ("indentation-kept", "x:\n    y", "x:\n    y"),
    ("nfc-composes", "e\u0301", "\u00e9"),
    ("nfc-keeps-superscript", "x\u00b2", "x\u00b2"),
    ("strip", "  hi  ", "hi"),
]


@pytest.mark.parametrize("name,raw,expected", TEXT_CASES, ids=[c[0] for c in TEXT_CASES])
def test_clean_text(name, raw, expected):
    assert clean_text(raw) == expected


def test_nfkc_is_selectable():
    assert clean_text("x\u00b2 \uff21", "NFKC") == "x2 A"


def m(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


OK_CASES = [
    ("simple", m(("user", "q"), ("assistant", "a")), m(("user", "q"), ("assistant", "a"))),
    (
        "system",
        m(("system", "s"), ("user", "q"), ("assistant", "a")),
        m(("system", "s"), ("user", "q"), ("assistant", "a")),
    ),
    (
        "empty-system-dropped",
        m(("system", " "), ("user", "q"), ("assistant", "a")),
        m(("user", "q"), ("assistant", "a")),
    ),
    ("role-case", m(("User", "q"), ("ASSISTANT", "a")), m(("user", "q"), ("assistant", "a"))),
    (
        "multi-turn",
        m(("user", "1"), ("assistant", "2"), ("user", "3"), ("assistant", "4")),
        m(("user", "1"), ("assistant", "2"), ("user", "3"), ("assistant", "4")),
    ),
    ("cleans-content", m(("user", " q\u00a0\r\n"), ("assistant", "a\x07")), m(("user", "q"), ("assistant", "a"))),
]


@pytest.mark.parametrize("name,messages,expected", OK_CASES, ids=[c[0] for c in OK_CASES])
def test_clean_messages_keeps(name, messages, expected):
    assert clean_messages(messages, CleaningRules()) == expected


REJECT_CASES = [
    ("assistant-first", m(("assistant", "a"), ("user", "q")), CleaningRules(), "bad_role_order"),
    ("two-users", m(("user", "q"), ("user", "q2"), ("assistant", "a")), CleaningRules(), "bad_role_order"),
    ("system-late", m(("user", "q"), ("system", "s"), ("assistant", "a")), CleaningRules(), "bad_role_order"),
    ("ends-with-user", m(("user", "q"), ("assistant", "a"), ("user", "q2")), CleaningRules(), "no_assistant_reply"),
    ("only-system", m(("system", "s")), CleaningRules(), "no_assistant_reply"),
    ("unknown-role", m(("user", "q"), ("bot2", "a")), CleaningRules(), "unknown_role"),
    ("empty-answer", m(("user", "q"), ("assistant", "  ")), CleaningRules(), "empty_answer"),
    ("empty-user", m(("user", "\u200b"), ("assistant", "a")), CleaningRules(), "empty_message"),
    ("short-answer", m(("user", "q"), ("assistant", "ab")), CleaningRules(min_response_chars=3), "too_short"),
    ("short-user", m(("user", "q"), ("assistant", "abc")), CleaningRules(min_chars=2), "too_short"),
    ("too-long", m(("user", "q" * 10), ("assistant", "a" * 10)), CleaningRules(max_chars=19), "too_long"),
]


@pytest.mark.parametrize("name,messages,rules,reason", REJECT_CASES, ids=[c[0] for c in REJECT_CASES])
def test_clean_messages_rejects_with_reason(name, messages, rules, reason):
    with pytest.raises(RowError) as err:
        clean_messages(messages, rules)
    assert err.value.reason == reason
    assert err.value.detail
