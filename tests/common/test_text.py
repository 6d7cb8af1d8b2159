"""Text cut short for one-line messages: `one_line` keeps a first word longer than the width (a long path or URL)
instead of leaving the placeholder alone, as `textwrap.shorten` does."""

from __future__ import annotations

import textwrap

from common.text import clip, one_line


def test_one_line_cuts_at_a_word_and_inside_a_first_word_longer_than_the_width():
    url = "http://store.example/" + "x" * 300
    assert textwrap.shorten(f"{url} refused", 40, placeholder=" ...") == "..."  # what it replaces
    assert one_line(f"{url} refused", 40) == (url[:36] + " ...") and len(one_line(f"{url} refused", 40)) == 40
    assert one_line("a  b\n\nc", 40) == "a b c"  # whitespace collapsed, nothing cut
    assert one_line("hello world " * 10, 30) == "hello world hello world ..."  # at a word
    assert one_line("", 10) == "" and one_line("x" * 50, 10, placeholder="...") == "x" * 7 + "..."


def test_clip_keeps_whitespace():
    assert clip("ab\n\ncd", 3) == "ab\n..." and clip("ab", 3) == "ab"
